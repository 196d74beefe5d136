"""The checkpoint layout transformers' BART, mBART, Marian and M2M100 share (fairseq's): `model.`
encoder and decoder stacks of `layers.{i}` with `self_attn`, `encoder_attn`, `fc1` / `fc2` and a
norm after each, a shared or per-stack token embedding, a `lm_head` and a `final_logits_bias`.
Encoder and decoder may differ in depth, heads and feed-forward width. What a family adds is a
`Layout`: where its norms go, whether its embeddings are normed, its position tables; the
vocabularies' sizes and a source embedding of its own are found in the weights. The family modules
(`marian`, `bart`, `m2m100`) say which."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from seq2seq_models.config import ModelConfig
from seq2seq_models.hf_import.common import (
    activation,
    copy_attention,
    copy_linear,
    copy_norm,
    replace,
    special_ids,
    token_embeddings,
)

PREFIX = "model."
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


@dataclass(frozen=True)
class Layout:
    """What one family's checkpoint is, within the shared layout."""

    pre_norm: bool  # x + f(norm(x)) with a final norm on each stack (mBART, M2M100); else post-LN
    embed_norm: bool  # a LayerNorm on each stack's embedded input (BART, mBART)
    source_positions: torch.Tensor  # [max_len, d]
    target_positions: torch.Tensor


def convert(c: Any, gen: Any, w: dict, mask_id: int | None, layout: Layout) -> tuple[ModelConfig, dict]:
    """specdec's config and state dict of a checkpoint in this layout (`c`: its config, `gen`: its
    generation config, `w`: its float32 state dict)."""
    heads, ffn, d = c.encoder_attention_heads, c.encoder_ffn_dim, c.d_model
    p = PREFIX
    dec_embed, src_embed = token_embeddings(w, p)
    vocab = dec_embed.shape[0]  # the target vocabulary's (Marian's `decoder_vocab_size` when separate)
    cfg = ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_heads=heads,
        encoder_layers=c.encoder_layers,
        decoder_layers=c.decoder_layers,
        ffn_dim=ffn,
        # The decoder's own shape where it differs (0: the encoder's).
        decoder_heads=0 if c.decoder_attention_heads == heads else c.decoder_attention_heads,
        decoder_ffn_dim=0 if c.decoder_ffn_dim == ffn else c.decoder_ffn_dim,
        max_len=layout.source_positions.shape[0],
        dropout=0.0,
        **special_ids(c, gen, vocab, mask_id),
        norm_position="pre" if layout.pre_norm else "post",
        final_norm=layout.pre_norm,
        embed_norm=layout.embed_norm,
        embed_scale=math.sqrt(d) if c.scale_embedding else 1.0,
        activation=activation(c.activation_function),
        src_vocab_size=0 if src_embed is None else src_embed.shape[0],
    )
    ours: dict[str, torch.Tensor] = {"embed.weight": dec_embed}
    if src_embed is not None:
        ours["src_embed.weight"] = src_embed
    ours["src_pos.weight"] = layout.source_positions
    ours["tgt_pos.weight"] = layout.target_positions
    if layout.embed_norm:
        copy_norm(ours, "src_embed_norm", w, f"{p}encoder.layernorm_embedding")
        copy_norm(ours, "tgt_embed_norm", w, f"{p}decoder.layernorm_embedding")
    if layout.pre_norm:
        copy_norm(ours, "encoder_norm", w, f"{p}encoder.layer_norm")
        copy_norm(ours, "decoder_norm", w, f"{p}decoder.layer_norm")
    for i in range(cfg.encoder_layers):
        src, dst = f"{p}encoder.layers.{i}.", f"encoder_layers.{i}."
        copy_attention(ours, dst + "attn", w, src + "self_attn", PROJECTIONS)
        copy_norm(ours, dst + "attn_norm", w, src + "self_attn_layer_norm")
        _copy_ffn(ours, dst, w, src)
    for i in range(cfg.decoder_layers):
        src, dst = f"{p}decoder.layers.{i}.", f"decoder_layers.{i}."
        copy_attention(ours, dst + "self_attn", w, src + "self_attn", PROJECTIONS)
        copy_norm(ours, dst + "self_norm", w, src + "self_attn_layer_norm")
        copy_attention(ours, dst + "cross_attn", w, src + "encoder_attn", PROJECTIONS)
        copy_norm(ours, dst + "cross_norm", w, src + "encoder_attn_layer_norm")
        _copy_ffn(ours, dst, w, src)
    head = w.get("lm_head.weight", dec_embed)
    if not torch.equal(head, dec_embed):
        cfg = replace(cfg, tied_head=False)
        ours["lm_head.weight"] = head
    bias = w.get("final_logits_bias")
    ours["out_bias"] = bias.reshape(-1) if bias is not None else torch.zeros(vocab)
    return cfg, ours


def learnt_positions(w: dict, stack: str, max_len: int) -> torch.Tensor:
    """A learnt table (BART, mBART), whose first two rows are never used (fairseq's offset 2)."""
    return w[f"{PREFIX}{stack}.embed_positions.weight"][2 : 2 + max_len]


def _copy_ffn(ours: dict, dst: str, w: dict, src: str) -> None:
    copy_linear(ours, dst + "ffn.up", w, src + "fc1")
    copy_linear(ours, dst + "ffn.down", w, src + "fc2")
    copy_norm(ours, dst + "ffn_norm", w, src + "final_layer_norm")
