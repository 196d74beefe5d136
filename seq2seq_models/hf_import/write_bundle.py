"""`specdec import-hf`'s work: a checkpoint (and optionally a smaller one of the same vocabulary as
its AR drafter) written as a bundle every other command takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from seq2seq_models.hf_import.checkpoint import build_model, check_same_vocabulary, import_checkpoint
from seq2seq_models.hf_import.tokenizer import import_tokenizer


def write_bundle(model_dir: Path, out: Path, ar_drafter_dir: Path | None = None, name: str | None = None) -> Path:
    """Import `model_dir` as the verifier (and `ar_drafter_dir` as the AR drafter) into bundle `out`."""
    from seq2seq_models.bundle import save_imported_bundle

    verifier = import_checkpoint(model_dir)
    models = {"verifier": build_model(verifier)}
    metadata: dict[str, Any] = {
        "kind": "hf-import",
        "model_type": verifier.model_type,
        "source": model_dir.name,
        "generation": verifier.generation,
    }
    if ar_drafter_dir is not None:
        drafter = import_checkpoint(ar_drafter_dir)
        check_same_vocabulary(verifier, drafter, ar_drafter_dir)
        models["ar_drafter"] = build_model(drafter)
        metadata["ar_drafter"] = {"model_type": drafter.model_type, "source": ar_drafter_dir.name}
    out.mkdir(parents=True, exist_ok=True)
    forced = verifier.generation.get("forced_bos_token_id")
    spec = import_tokenizer(model_dir, out, verifier.config.eos_id, forced)
    return save_imported_bundle(out, models, name or model_dir.name, spec, metadata)
