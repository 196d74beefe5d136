"""The README's Python example, run as a user runs it: in-process (`Engine.load()`, the bundle from
$SPECDEC_BUNDLE) and against `serve all` (the same code with `Engine.connect()`, the gateway from
$SPECDEC_ADDR), printing the same outputs both ways."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import specdec
from seq2seq_models.bundle import make_tiny_bundle
from specdec.serve import ServiceStack

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = {role: {"address": "127.0.0.1:0"} for role in ("gateway", "verifier", "drafter")}


def readme_example() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert len(blocks) == 1, "the README has one Python example"
    return blocks[0]


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("readme-bundle"), seed=3)


def _run(code: str, env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", **env})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stdout


def test_the_readme_example_runs_in_process_and_against_a_gateway(bundle_dir):
    code = readme_example()
    assert "Engine.load()" in code
    local = _run(code, {"SPECDEC_BUNDLE": str(bundle_dir)})
    with specdec.Engine.load(bundle_dir) as engine:  # what it should print, from the library itself
        first = engine.generate("Я хочу подякувати вам.", mode="gad", k=10)
        many = engine.generate(["Перше речення.", "Друге речення."], mode="iad")
    lines = local.splitlines()
    assert lines[0] == f"{first.text} {first.stats.mean_accepted_length}"
    assert lines[1:3] == [o.text for o in many]
    assert lines[3] == first.text  # the streamed chunks join into the same text
    with ServiceStack("all", bundle_dir, LOOPBACK) as stack:
        remote = _run(code.replace("Engine.load()", "Engine.connect()"),
                      {"SPECDEC_ADDR": stack.running.addresses["gateway"]})
    remote_lines = remote.splitlines()
    assert remote_lines[0].split(" ")[:-1] == lines[0].split(" ")[:-1]  # the same text (stats may differ)
    assert remote_lines[1:] == lines[1:]
