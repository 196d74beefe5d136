"""`specdec import-hf`'s work: a checkpoint (and optionally a smaller one of the same vocabulary as
its AR drafter) written as a bundle every other command takes. The bundle directory is new or
empty, or replaced whole when asked: never written into, where an earlier bundle's drafters, caches
and card would be left behind. It is written beside its place and renamed, so an import that fails
leaves nothing half-written."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from seq2seq_models.hf_import.checkpoint import build_model, check_same_vocabulary, import_checkpoint
from seq2seq_models.hf_import.tokenizer import import_tokenizer


def write_bundle(
    model_dir: Path, out: Path, ar_drafter_dir: Path | None = None, name: str | None = None, force: bool = False,
    report: Callable[[str], None] | None = None,
) -> Path:
    """Import `model_dir` as the verifier (and `ar_drafter_dir` as the AR drafter) into bundle `out`;
    `force`: replace a non-empty `out` whole. `report` hears which generation settings became the
    bundle's decoding defaults and which were not taken, and why."""
    from seq2seq_models.bundle import save_imported_bundle

    check_out(out, force)
    verifier = import_checkpoint(model_dir)
    models = {"verifier": build_model(verifier)}
    metadata: dict[str, Any] = {
        "kind": "hf-import",
        "model_type": verifier.model_type,
        "source": model_dir.name,
        "generation": verifier.generation,
        # generate()'s settings in force for every request unless it or a door's defaults say otherwise.
        "decoding_defaults": verifier.defaults.defaults,
    }
    if ar_drafter_dir is not None:
        drafter = import_checkpoint(ar_drafter_dir)
        check_same_vocabulary(verifier, drafter, ar_drafter_dir)
        models["ar_drafter"] = build_model(drafter)
        metadata["ar_drafter"] = {"model_type": drafter.model_type, "source": ar_drafter_dir.name}
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        forced = verifier.generation.get("forced_bos_token_id")
        spec = import_tokenizer(model_dir, tmp, verifier.config.eos_id, forced)
        save_imported_bundle(tmp, models, name or model_dir.name, spec, metadata)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    if report is not None:  # once written: a failed import says one line, its error
        for line in verifier.defaults.lines():
            report(line)
    return out


def check_out(out: Path, force: bool) -> None:
    """`out` must be new or an empty directory; with `force`, any directory (it is replaced whole)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} is not empty: give a new or empty directory, or --force to replace it whole")
