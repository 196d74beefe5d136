"""Marian (opus-mt): post-LN, sinusoidal positions (the sine half, then the cosine half), SiLU by
default, embeddings scaled by sqrt(d), a logits bias; the source embedding is its own when the
vocabularies are separate (`share_encoder_decoder_embeddings` false), of its own size too
(`vocab_size` the source's, `decoder_vocab_size` the target's: the layout reads both off the
weights)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from seq2seq_models.config import ModelConfig
from seq2seq_models.hf_import import bart_layout

MODEL_TYPES = ("marian",)


def convert(c: Any, gen: Any, w: dict, mask_id: int | None) -> tuple[ModelConfig, dict]:
    table = sinusoids(c.max_position_embeddings, c.d_model)
    layout = bart_layout.Layout(
        pre_norm=False, embed_norm=False, source_positions=table, target_positions=table.clone(),
    )
    return bart_layout.convert(c, gen, w, mask_id, layout)


def sinusoids(length: int, dim: int) -> torch.Tensor:
    """Marian's table: sines of the even frequencies in the first half, cosines in the second."""
    pos = np.arange(length, dtype=np.float64)[:, None]
    j = np.arange(dim)[None, :]
    enc = pos / np.power(10000, 2 * (j // 2) / dim)
    half = dim // 2 + dim % 2
    table = np.zeros((length, dim))
    table[:, :half] = np.sin(enc[:, 0::2])
    table[:, half:] = np.cos(enc[:, 1::2])
    return torch.tensor(table, dtype=torch.float32)
