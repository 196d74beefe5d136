"""M2M100 and NLLB: pre-LN with final LayerNorms, sinusoidal positions (fairseq's layout) offset by
the padding id plus one, ReLU."""

from __future__ import annotations

import math
from typing import Any

import torch

from seq2seq_models.config import ModelConfig
from seq2seq_models.hf_import import bart_layout

MODEL_TYPES = ("m2m_100",)


def convert(c: Any, gen: Any, w: dict, mask_id: int | None) -> tuple[ModelConfig, dict]:
    offset = c.pad_token_id + 1
    table = sinusoids(c.max_position_embeddings + offset, c.d_model, c.pad_token_id)[offset:]
    layout = bart_layout.Layout(
        pre_norm=True, embed_norm=False, source_positions=table, target_positions=table.clone(),
    )
    return bart_layout.convert(c, gen, w, mask_id, layout)


def sinusoids(length: int, dim: int, padding_idx: int) -> torch.Tensor:
    """fairseq's table: sines then cosines of dim/2 frequencies, the padding row zero."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
    angles = torch.arange(length, dtype=torch.int64).float()[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(length, 1)], dim=1)
    table[padding_idx] = 0
    return table
