"""T5, mT5 and flan-T5: RMSNorm, a bucketed relative position bias shared by a stack's layers, no
attention scaling (folded into the query projection here), ReLU or a gated activation, and a tied
head scaled by d_model^-0.5 (folded into the final norm's gain) or a head of its own."""

from __future__ import annotations

import math
from typing import Any

import torch

from seq2seq_models.config import ModelConfig
from seq2seq_models.hf_import.common import activation, copy_attention, first, special_ids, token_embeddings

MODEL_TYPES = ("t5", "mt5")
# Longest source / target a T5 bundle takes (relative positions set no limit of their own).
MAX_LEN = 512
PROJECTIONS = ("q", "k", "v", "o")


def convert(c: Any, gen: Any, w: dict, mask_id: int | None) -> tuple[ModelConfig, dict]:
    gated = c.feed_forward_proj.startswith("gated-")
    act_name = c.feed_forward_proj.split("-")[-1]
    if gated and act_name == "gelu":
        act_name = "gelu_new"  # transformers maps gated-gelu to the tanh approximation
    tied = getattr(c, "tie_word_embeddings", True) is not False
    d, hd = c.d_model, c.d_kv
    embed, src_embed = token_embeddings(w)
    cfg = ModelConfig(
        vocab_size=c.vocab_size,
        d_model=d,
        n_heads=c.num_heads,
        head_dim=hd,
        encoder_layers=c.num_layers,
        decoder_layers=c.num_decoder_layers or c.num_layers,
        ffn_dim=c.d_ff,
        max_len=MAX_LEN,
        dropout=0.0,
        # T5 checkpoints start the decoder from the padding token.
        **special_ids(c, gen, c.vocab_size, mask_id, default_start=first(gen, c, "pad_token_id")),
        norm_kind="rms",
        norm_eps=c.layer_norm_epsilon,
        embed_scale=1.0,
        positions="relative",
        relative_buckets=c.relative_attention_num_buckets,
        relative_max_distance=c.relative_attention_max_distance,
        activation=activation(act_name),
        gated_ffn=gated,
        linear_bias=False,
        tied_head=tied,
        src_vocab_size=0 if src_embed is None else src_embed.shape[0],
    )
    # T5 does not scale its attention scores; the kernels divide by sqrt(head_dim), so the query
    # projection is multiplied by it here.
    q_scale = math.sqrt(hd)
    ours: dict[str, torch.Tensor] = {"embed.weight": embed}
    if src_embed is not None:
        ours["src_embed.weight"] = src_embed
    ours["src_rel_bias.weight"] = w["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    ours["tgt_rel_bias.weight"] = w["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
    ours["encoder_norm.weight"] = w["encoder.final_layer_norm.weight"]
    decoder_norm = w["decoder.final_layer_norm.weight"]
    # The tied head scales the final states by d_model^-0.5; the final norm's gain carries it.
    # transformers 5 ties every T5 head and says apart whether it scales (`scale_decoder_outputs`).
    scaled = getattr(c, "scale_decoder_outputs", tied)
    ours["decoder_norm.weight"] = decoder_norm * d**-0.5 if scaled else decoder_norm
    for i in range(cfg.encoder_layers):
        src, dst = f"encoder.block.{i}.layer.", f"encoder_layers.{i}."
        copy_attention(ours, dst + "attn", w, src + "0.SelfAttention", PROJECTIONS, q_scale)
        ours[dst + "attn_norm.weight"] = w[src + "0.layer_norm.weight"]
        _copy_ffn(ours, dst + "ffn", w, src + "1.DenseReluDense", gated)
        ours[dst + "ffn_norm.weight"] = w[src + "1.layer_norm.weight"]
    for i in range(cfg.decoder_layers):
        src, dst = f"decoder.block.{i}.layer.", f"decoder_layers.{i}."
        copy_attention(ours, dst + "self_attn", w, src + "0.SelfAttention", PROJECTIONS, q_scale)
        ours[dst + "self_norm.weight"] = w[src + "0.layer_norm.weight"]
        copy_attention(ours, dst + "cross_attn", w, src + "1.EncDecAttention", PROJECTIONS, q_scale)
        ours[dst + "cross_norm.weight"] = w[src + "1.layer_norm.weight"]
        _copy_ffn(ours, dst + "ffn", w, src + "2.DenseReluDense", gated)
        ours[dst + "ffn_norm.weight"] = w[src + "2.layer_norm.weight"]
    if not tied:
        ours["lm_head.weight"] = w["lm_head.weight"]
    ours["out_bias"] = torch.zeros(c.vocab_size)
    return cfg, ours


def _copy_ffn(ours: dict, dst: str, w: dict, src: str, gated: bool) -> None:
    if gated:
        ours[f"{dst}.up.weight"] = w[f"{src}.wi_0.weight"]
        ours[f"{dst}.gate.weight"] = w[f"{src}.wi_1.weight"]
    else:
        ours[f"{dst}.up.weight"] = w[f"{src}.wi.weight"]
    ours[f"{dst}.down.weight"] = w[f"{src}.wo.weight"]
