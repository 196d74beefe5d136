"""BART and mBART: learnt positions (offset 2) and a LayerNorm on the embeddings; BART is post-LN
with GELU, mBART pre-LN with a final LayerNorm on each stack."""

from __future__ import annotations

from typing import Any

from seq2seq_models.config import ModelConfig
from seq2seq_models.hf_import import bart_layout

MODEL_TYPES = ("bart", "mbart")


def convert(c: Any, gen: Any, w: dict, mask_id: int | None) -> tuple[ModelConfig, dict]:
    max_len = c.max_position_embeddings
    layout = bart_layout.Layout(
        pre_norm=c.model_type == "mbart", embed_norm=True,
        source_positions=bart_layout.learnt_positions(w, "encoder", max_len),
        target_positions=bart_layout.learnt_positions(w, "decoder", max_len),
    )
    return bart_layout.convert(c, gen, w, mask_id, layout)
