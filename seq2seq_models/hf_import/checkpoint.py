"""A checkpoint read as specdec's config and weights: the family's converter from the registry, the
checkpoint's decoding settings, and the model built from them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from seq2seq_models.config import ModelConfig
from seq2seq_models.hf_import.common import UnsupportedModel, first
from seq2seq_models.hf_import.registry import converter, read_model_type

# The output bias of a token `generate` never emits: far below any real logit, and finite in float16.
SUPPRESSED_LOGIT = -1e4


@dataclass
class ImportedModel:
    config: ModelConfig
    state: dict[str, torch.Tensor]
    model_type: str
    # Decoding settings from config.json / generation_config.json (forced first token, ...).
    generation: dict[str, Any]


def import_checkpoint(model_dir: str | Path, mask_id: int | None = None) -> ImportedModel:
    """Read `model_dir` with transformers and return specdec's config and float32 state dict."""
    model_type = read_model_type(model_dir)
    from transformers import AutoModelForSeq2SeqLM
    from transformers.utils import logging as hf_logging

    # The command's own output is one line; transformers' progress bars and notices are not.
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    hf = AutoModelForSeq2SeqLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    config, ours = converter(model_type)(hf.config, hf.generation_config, state, mask_id)
    _suppress_bad_words(ours, first(hf.generation_config, hf.config, "bad_words_ids"))
    return ImportedModel(config=config, state=ours, model_type=model_type, generation=_generation(hf))


def build_model(imported: ImportedModel):  # -> Seq2SeqTransformer
    from seq2seq_models.transformer import Seq2SeqTransformer

    model = Seq2SeqTransformer(imported.config)
    missing, unexpected = model.load_state_dict(imported.state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"weight mapping incomplete: missing {missing}, unexpected {unexpected}")
    return model.eval()


def check_same_vocabulary(verifier: ImportedModel, drafter: ImportedModel, drafter_dir: str | Path) -> None:
    """An AR drafter must speak the verifier's token ids: same vocabulary size and special ids."""
    v, d = verifier.config, drafter.config
    keys = ("vocab_size", "source_vocab_size", "pad_id", "bos_id", "eos_id")
    differ = [k for k in keys if getattr(v, k) != getattr(d, k)]
    if differ:
        detail = ", ".join(f"{k} {getattr(d, k)} vs {getattr(v, k)}" for k in differ)
        raise UnsupportedModel(f"{drafter_dir} has another vocabulary than the verifier ({detail})")


def _suppress_bad_words(ours: dict, bad_words_ids: Any) -> None:
    """Single-token `bad_words_ids` (opus-mt's padding token) folded into the output bias, so that
    greedy, and every mode, never emits them, as `generate` and CTranslate2 do."""
    single = [ids[0] for ids in bad_words_ids or [] if len(ids) == 1]
    if single:
        ours["out_bias"] = ours["out_bias"].clone()
        ours["out_bias"][single] = SUPPRESSED_LOGIT


def _generation(hf: Any) -> dict[str, Any]:
    """The decoding settings greedy must honour (a forced first token)."""
    return {"forced_bos_token_id": first(hf.generation_config, hf.config, "forced_bos_token_id")}
