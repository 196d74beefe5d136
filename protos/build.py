"""Build the Python stubs of the specdec wire contracts from the ``.proto`` files.

The ``.proto`` files under ``protos/`` (package ``specdec.v1`` in ``protos/specdec/v1/``) are the
only source of wire types. Their Python stubs are generated, never committed:

    specdec/v1/<name>_pb2.py        messages          (protoc --python_out)
    specdec/v1/<name>_pb2.pyi       type stubs        (protoc --pyi_out)
    specdec/v1/<name>_pb2_grpc.py   service stubs     (grpc_tools --grpc_python_out)

How they get built:

* automatically: importing ``protos.specdec.v1`` calls :func:`ensure_stubs`, which regenerates
  the stubs when any is missing or when the ``.proto`` files (or this module) changed since the
  last build. The check hashes a few small files, well under a millisecond;
* by hand: ``python -m protos.build`` (same check), ``python -m protos.build --force`` (always
  rebuild, e.g. after upgrading grpcio-tools), ``python -m protos.build --check`` (exit 1 when
  the stubs are missing or out of date; builds nothing).

protoc names a generated module after its proto package (``from specdec.v1 import common_pb2``),
which here would resolve to the project's own top-level ``specdec`` Python package. The build
rewrites those imports to ``from protos.specdec.v1 import ...`` so the stubs work as the package
``protos.specdec.v1``, while the proto files keep their buf-standard paths (``specdec/v1/...``,
which is also what server reflection reports).

The build needs ``grpcio-tools`` (it runs its bundled protoc); the generated code needs
``protobuf`` and ``grpcio`` at run time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

# protos/: the proto root (-I for protoc, the buf module) and the Python package the stubs live in.
PROTO_ROOT = Path(__file__).resolve().parent
# The Python package that corresponds to PROTO_ROOT ("protos").
PY_PACKAGE = (__spec__.parent if __spec__ is not None and __spec__.parent else None) or PROTO_ROOT.name
# Suffixes of the files protoc generates next to each <name>.proto.
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# Records which inputs the stubs in a directory were built from (a hash; see inputs_digest).
STAMP_NAME = ".stubs.sha256"


class StubBuildError(RuntimeError):
    """protoc failed, or the stubs are missing and cannot be built."""


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """All ``.proto`` files under ``root``, sorted."""
    return sorted(p for p in root.rglob("*.proto") if p.is_file())


def expected_outputs(protos: Sequence[Path]) -> list[Path]:
    """The generated files that ``protos`` produce, next to their sources."""
    return [p.with_name(p.stem + suffix) for p in protos for suffix in GENERATED_SUFFIXES]


def inputs_digest(protos: Sequence[Path], root: Path = PROTO_ROOT) -> str:
    """A hash of everything the stubs depend on: the proto files (paths and contents) and this
    module (it decides how the stubs are post-processed)."""
    digest = hashlib.sha256()
    for path in [*protos, Path(__file__).resolve()]:
        name = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
        digest.update(name.encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _stamp_paths(protos: Sequence[Path]) -> list[Path]:
    return sorted({p.parent / STAMP_NAME for p in protos})


def stubs_are_stale(root: Path = PROTO_ROOT) -> bool:
    """True when a generated file is missing or the stubs were built from other inputs.

    Without any ``.proto`` file (e.g. an install that ships only the stubs) there is nothing
    to compare with, and the stubs count as fresh.
    """
    protos = proto_files(root)
    if not protos:
        return False
    if not all(p.is_file() for p in expected_outputs(protos)):
        return True
    digest = inputs_digest(protos, root)
    for stamp in _stamp_paths(protos):
        try:
            if stamp.read_text().strip() != digest:
                return True
        except OSError:
            return True
    return False


def _local_top_packages(protos: Sequence[Path], root: Path) -> set[str]:
    """Top-level proto package directories under ``root`` (``{"specdec"}`` here)."""
    return {p.relative_to(root).parts[0] for p in protos if len(p.relative_to(root).parts) > 1}


def fix_imports(source: str, top_packages: set[str], py_package: str = PY_PACKAGE) -> str:
    """Rewrite protoc's imports of local proto packages so they resolve inside ``py_package``:
    ``from specdec.v1 import x_pb2`` becomes ``from protos.specdec.v1 import x_pb2`` (and the
    same for ``import specdec.v1.x_pb2`` forms). Other imports (google.protobuf, grpc) stay."""
    if not top_packages:
        return source
    names = "|".join(sorted(re.escape(name) for name in top_packages))
    pattern = re.compile(rf"^(\s*)(from|import)\s+((?:{names})(?:\.|\s))", re.MULTILINE)
    return pattern.sub(lambda m: f"{m.group(1)}{m.group(2)} {py_package}.{m.group(3)}", source)


def generate_stubs(root: Path = PROTO_ROOT, py_package: str = PY_PACKAGE) -> list[Path]:
    """Regenerate the stubs of every ``.proto`` under ``root`` (unconditionally) and return
    the generated files.

    protoc writes into a temporary directory under ``root``; each file is import-fixed there
    and then moved into place with an atomic rename, and the stamp is written last, so a
    concurrent importer sees either the old or the new version of each file, never a torn one.
    """
    protos = proto_files(root)
    if not protos:
        raise StubBuildError(f"no .proto files under {root}")
    try:
        import grpc_tools  # the package that bundles protoc and the gRPC Python plugin
    except ImportError as exc:
        raise StubBuildError(
            "building the specdec.v1 stubs needs grpcio-tools (pip install grpcio-tools)"
        ) from exc
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"

    tmp = Path(tempfile.mkdtemp(prefix=".stubs-build-", dir=root))
    try:
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={root}",
            f"--proto_path={well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(p.relative_to(root).as_posix() for p in protos),
        ]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise StubBuildError(
                f"protoc failed (exit {proc.returncode}):\n{proc.stderr.strip() or proc.stdout.strip()}"
            )
        top_packages = _local_top_packages(protos, root)
        written: list[Path] = []
        for dest in expected_outputs(protos):
            produced = tmp / dest.relative_to(root)
            if not produced.is_file():
                raise StubBuildError(f"protoc did not produce {produced.relative_to(tmp)}")
            produced.write_text(fix_imports(produced.read_text(), top_packages, py_package))
            os.replace(produced, dest)
            written.append(dest)
        digest = inputs_digest(protos, root)
        for stamp in _stamp_paths(protos):
            stamp_tmp = tmp / (stamp.name + "." + stamp.parent.name)
            stamp_tmp.write_text(digest + "\n")
            os.replace(stamp_tmp, stamp)
        return written
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_stubs(root: Path = PROTO_ROOT, *, force: bool = False) -> bool:
    """Make sure the stubs under ``root`` exist and match the ``.proto`` files; return True
    when they were (re)built.

    When the stubs are stale but cannot be rebuilt (no grpcio-tools, read-only install) and a
    complete older set exists, that set is used with a warning; when stubs are missing and
    cannot be built, :class:`StubBuildError` is raised.
    """
    if not force and not stubs_are_stale(root):
        return False
    try:
        generate_stubs(root)
    except (StubBuildError, OSError) as exc:
        protos = proto_files(root)
        complete = bool(protos) and all(p.is_file() for p in expected_outputs(protos))
        if force or not complete:
            raise StubBuildError(f"cannot build the specdec.v1 Python stubs: {exc}") from exc
        warnings.warn(
            f"specdec.v1 stubs are out of date with the .proto files and could not be rebuilt "
            f"({exc}); using the existing ones. Run: python -m protos.build --force",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m protos.build [--force | --check]``."""
    parser = argparse.ArgumentParser(
        prog="python -m protos.build", description="Build the specdec.v1 Python gRPC stubs."
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--force", action="store_true", help="rebuild even when up to date")
    group.add_argument(
        "--check", action="store_true", help="exit 1 if the stubs are missing or stale; build nothing"
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = stubs_are_stale()
        print("specdec.v1 stubs are " + ("STALE or missing" if stale else "up to date"))
        return 1 if stale else 0
    try:
        built = ensure_stubs(force=args.force)
    except StubBuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    print("specdec.v1 stubs " + ("built" if built else "already up to date") + f" in {PROTO_ROOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
