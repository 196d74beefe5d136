"""What `pip install .` brings: serving on ONNX Runtime needs no torch, no test or benchmark tools;
torch, training, Hugging Face, dev and bench are extras, and `all` is everything the tests need."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
TORCH = "torch==2.13.0"


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_base_install_is_what_serving_on_onnx_runtime_needs() -> None:
    base = _names(PROJECT["dependencies"])
    assert base.isdisjoint({"torch", "ctranslate2", "pytest", "pytest-xdist", "triton", "ua-gec", "transformers"})
    # tokenizers runs an imported checkpoint's own tokenizer.json (no transformers at run time).
    assert {"onnxruntime", "grpcio", "numpy", "sentencepiece", "tokenizers"} <= base


def test_the_extras_and_the_torch_pin() -> None:
    extras = PROJECT["optional-dependencies"]
    assert extras["torch"] == [TORCH]
    assert TORCH in extras["hf"] and "transformers" in _names(extras["hf"])
    assert {TORCH, "ua-gec>=2.1"} <= set(extras["train"])
    assert extras["all"] == ["specdec[torch,train,hf,dev,bench]"]
    # torch, wherever it is named, is the exact pin: nothing may pull a newer (multi-GB CUDA) build.
    named = [r for reqs in (PROJECT["dependencies"], *extras.values()) for r in reqs if _names([r]) == {"torch"}]
    assert named and set(named) == {TORCH}
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'python -m pip install --quiet "{TORCH}" -e ".[all]"' in ci


BLOCK_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'")
sys.meta_path.insert(0, NoTorch())
import specdec.cli, specdec.serve, gateway.server, verifier_service.server, drafter_service.server
from specdec.cli import main
try:
    main(["--help"])
except SystemExit as exc:
    assert exc.code == 0
assert "torch" not in sys.modules
print("ok")
"""


def test_the_serving_path_imports_without_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")
