"""The package layering of ARCHITECTURE.md: every import between our packages points downwards,
there are no cycles, and the gateway process never loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Collection, Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Each package and the packages of ours it may import (ARCHITECTURE.md, "Layers").
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "protos": set(),
    "kernels": {"core"},
    "decoding": {"core"},
    "serving": {"core", "protos"},
    "seq2seq_models": {"core", "kernels"},
    "verifier_service": {"core", "kernels", "protos", "seq2seq_models", "serving"},
    "drafter_service": {"core", "kernels", "protos", "seq2seq_models", "serving"},
    "gateway": {"core", "decoding", "protos", "seq2seq_models", "serving"},
    "training": {"core", "kernels", "seq2seq_models"},
    "evaluation": {
        "core", "decoding", "drafter_service", "gateway", "protos", "seq2seq_models", "serving", "training",
        "verifier_service",
    },
    "specdec": {
        "core", "decoding", "drafter_service", "evaluation", "gateway", "kernels", "protos", "seq2seq_models",
        "serving", "training", "verifier_service",
    },
}


def layers() -> dict[str, int]:
    """Each package's layer (ARCHITECTURE.md, "Layers"): 0 for one that may import nothing of ours,
    else one above the highest layer it may import."""
    found: dict[str, int] = {}

    def layer(package: str) -> int:
        if package not in found:
            found[package] = 1 + max((layer(p) for p in ALLOWED[package]), default=-1)
        return found[package]

    for package in ALLOWED:
        layer(package)
    return found


def our_modules() -> dict[str, Path]:
    """Every module of our packages (the generated stubs aside), by its dotted name."""
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for package in ALLOWED
        for path in (ROOT / package).rglob("*.py")
        if "_pb2" not in path.name
    }


def module_imports(statements: Iterable[ast.AST], modules: Collection[str]) -> set[str]:
    """The modules among `modules` that the import statements among `statements` import."""
    found: set[str] = set()
    for node in statements:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import name` imports pkg (its __init__), or pkg.name when that is a module.
            targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        found.update(t for t in targets if t in modules)
    return found


def package_imports() -> dict[str, dict[str, set[str]]]:
    """package -> imported package of ours -> the files that import it."""
    ours = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    found: dict[str, dict[str, set[str]]] = {p: {} for p in ours}
    for package in ours:
        for path in (ROOT / package).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in ours and top != package:
                        found[package].setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_package_is_placed_in_a_layer() -> None:
    assert set(package_imports()) == set(ALLOWED)


def test_imports_only_point_downwards() -> None:
    wrong = {
        f"{package} -> {target}": sorted(files)
        for package, targets in package_imports().items()
        for target, files in targets.items()
        if target not in ALLOWED[package]
    }
    assert not wrong, wrong


def test_no_import_cycles_between_packages() -> None:
    edges = {p: set(t) for p, t in package_imports().items()}

    def reaches(start: str) -> set[str]:
        seen: set[str] = set()
        stack = [start]
        while stack:
            for nxt in edges[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    cyclic = sorted(p for p in edges if p in reaches(p))
    assert not cyclic, f"packages on an import cycle: {cyclic}"


@pytest.mark.parametrize("module", ["gateway.server", "core.interfaces", "core.sampling", "specdec.client"])
def test_the_gateway_side_never_imports_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'onnxruntime') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_no_import_cycles_between_modules() -> None:
    """Module-level imports (lazy imports inside functions aside) form no cycle, inside a package too."""
    modules = our_modules()
    edges = {  # module level only
        name: module_imports(ast.parse(path.read_text(encoding="utf-8")).body, modules) - {name}
        for name, path in modules.items()
    }

    def on_cycle(start: str) -> bool:
        seen: set[str] = set()
        stack = [start]
        while stack:
            for nxt in edges[stack.pop()]:
                if nxt == start:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    cyclic = sorted(m for m in edges if on_cycle(m))
    assert not cyclic, f"modules on an import cycle: {cyclic}"


# Refuses torch the way an install without it does (the runtime image): ModuleNotFoundError.
NO_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoTorch())
"""


def _run_without_torch(code: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", NO_TORCH + code]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_the_onnx_serving_path_of_every_role_runs_without_torch(tmp_path) -> None:
    """With the graphs exported (as the image's build stage does), verifier and drafter servers start
    on ONNX Runtime, draft (NAR block, AR beam, AR sample) and verify, in a process where torch
    cannot be imported, in float32 and in int8 (whose graphs are quantized there from the float32
    export); a torch backend there is a one-line error naming the backend."""
    from seq2seq_models.bundle import make_tiny_bundle

    bundle = make_tiny_bundle(tmp_path / "bundle", seed=3)
    export = subprocess.run(
        [sys.executable, "-m", "specdec", "export-onnx", "--bundle", str(bundle)], capture_output=True, text=True,
        cwd=ROOT, check=True, timeout=300,
    )
    assert '"ar_drafter"' in export.stdout
    code = f"""
import asyncio
from core.config import ServiceSection
from core.sampling import SamplingParams
from drafter_service.server import DrafterServer
from verifier_service.server import VerifierServer

async def main():
    section = ServiceSection(address="127.0.0.1:0", backend="onnxruntime", device="cpu")
    verifier = await VerifierServer.start({str(bundle)!r}, section)
    drafter = await DrafterServer.start({str(bundle)!r}, section)
    print("OUT", verifier.model_info.backend, drafter.model_info.backend)
    d = drafter.drafter
    print("OUT", len(d.open([7, 8, 9]).draft_block(0, [], 4).ids), len(d.open([7, 8, 9]).draft_beam(0, [], 3, 2).ids),
          len(d.open([7, 8, 9], seed=1).draft_sample(0, [], 3, SamplingParams()).ids))
    session = verifier.verifier.open([7, 8, 9])
    print("OUT", len(session.step(0, [], [10, 11], 1).top1))
    await drafter.stop(0)
    await verifier.stop(0)
    int8 = ServiceSection(address="127.0.0.1:0", backend="onnxruntime", device="cpu", precision="int8")
    verifier = await VerifierServer.start({str(bundle)!r}, int8)
    drafter = await DrafterServer.start({str(bundle)!r}, int8)
    print("OUT", len(verifier.verifier.open([7, 8, 9]).step(0, [], [10, 11], 1).top1),
          len(drafter.drafter.open([7, 8, 9]).draft_block(0, [], 4).ids) >= 1)
    await drafter.stop(0)
    await verifier.stop(0)

asyncio.run(main())
print("OUT", sorted(m for m in ("torch", "safetensors.torch") if m in __import__("sys").modules))
"""
    out = _run_without_torch(code)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.removeprefix("OUT ") for line in out.stdout.splitlines() if line.startswith("OUT ")]  # not logs
    assert lines[0] == "onnxruntime-cpu onnxruntime-cpu"
    assert [int(n) >= 1 for n in lines[1].split()] == [True, True, True]
    assert lines[2] == "3"
    assert lines[3] == "3 True"
    assert lines[-1] == "[]"

    refused = _run_without_torch(
        f"import sys; from specdec.cli import main; sys.exit(main(['serve', 'drafter', '--bundle', {str(bundle)!r}, "
        "'--backend', 'torch', '--drafter-addr', '127.0.0.1:0']))"
    )
    assert refused.returncode != 0
    assert "backend = 'torch' needs torch, which is not installed here" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
