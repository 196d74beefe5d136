"""`specdec import-hf`: a Hugging Face seq2seq checkpoint (and optionally a smaller one of the same
vocabulary as its AR drafter) written as a bundle every other command takes.

Importing needs `transformers` (the `hf` extra); serving the bundle it writes does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def import_hf(model_dir: Path, out: Path, ar_drafter_dir: Path | None = None, name: str | None = None) -> Path:
    """Import `model_dir` as the verifier (and `ar_drafter_dir` as the AR drafter) into bundle `out`."""
    try:
        from seq2seq_models import hf_import
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ValueError(f"import-hf needs transformers and torch: pip install -e '.[hf]' ({exc})") from None
    from seq2seq_models.bundle import save_imported_bundle

    verifier = hf_import.import_checkpoint(model_dir)
    models = {"verifier": hf_import.build_model(verifier)}
    metadata: dict[str, Any] = {
        "kind": "hf-import",
        "model_type": verifier.model_type,
        "source": model_dir.name,
        "generation": verifier.generation,
    }
    if ar_drafter_dir is not None:
        drafter = hf_import.import_checkpoint(ar_drafter_dir)
        hf_import.check_same_vocabulary(verifier, drafter, ar_drafter_dir)
        models["ar_drafter"] = hf_import.build_model(drafter)
        metadata["ar_drafter"] = {"model_type": drafter.model_type, "source": ar_drafter_dir.name}
    out.mkdir(parents=True, exist_ok=True)
    forced = verifier.generation.get("forced_bos_token_id")
    spec = hf_import.import_tokenizer(model_dir, out, verifier.config.eos_id, forced)
    return save_imported_bundle(out, models, name or model_dir.name, spec, metadata)
