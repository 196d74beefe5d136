"""Marian (opus-mt): post-LN, sinusoidal positions (the sine half, then the cosine half), SiLU by
default, embeddings scaled by sqrt(d), a logits bias; the source embedding is its own when the
vocabularies are separate (`share_encoder_decoder_embeddings` false)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from seq2seq_models.config import ModelConfig
from seq2seq_models.hf_import import bart_layout
from seq2seq_models.hf_import.common import UnsupportedModel

MODEL_TYPES = ("marian",)


def convert(c: Any, gen: Any, w: dict, mask_id: int | None) -> tuple[ModelConfig, dict]:
    shared = getattr(c, "share_encoder_decoder_embeddings", True)
    vocab = getattr(c, "decoder_vocab_size", None) or c.vocab_size
    if not shared and c.vocab_size != vocab:
        # The services check source ids against one vocabulary size, the target's.
        raise UnsupportedModel(
            f"separate source and target vocabularies of different sizes ({c.vocab_size} and {vocab}) "
            "are not supported"
        )
    table = sinusoids(c.max_position_embeddings, c.d_model)
    layout = bart_layout.Layout(
        pre_norm=False, embed_norm=False, source_positions=table, target_positions=table.clone(),
        vocab_size=vocab, source_vocab_size=0 if shared else c.vocab_size,
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
