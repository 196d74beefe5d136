"""The Transformer's layers, each written once for every path that runs them.

Training, cached decoding and the ONNX export all call these same methods; what differs is passed
in: the attention kernel (`kernels.attention.EAGER` or `GRAPH`), the masks, the cross-attention
K/V, and for the decoder's self-attention how a block's K/V join the keys it attends over
(`JoinPast`: nothing for a whole target, the KV cache for incremental decoding, a concatenation
with the past for the exported graph). Dropout modules are identities in eval mode, and the
exporter drops them from the graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.attention import EAGER, AttentionKernel, KeysT, Parts
from seq2seq_models.config import ModelConfig, StackShape

# (block K, block V) [B, H, T, hd] -> the keys and values the block attends over [B, H, L, hd], or
# in `Parts` (past, block) that the kernel attends over as one.
JoinPast = Callable[[Tensor, Tensor], tuple[Tensor | Parts, Tensor | Parts]]


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        _add_sublayers(self, config, config.encoder_shape, ("attn_norm", "attn"))

    def forward(self, x: Tensor, mask: Tensor | None, kernel: AttentionKernel = EAGER) -> Tensor:
        def attend(h: Tensor) -> Tensor:
            q, k, v = self.attn.project_qkv(h, kernel)
            return self.attn.attend_heads(q, k, v, mask, kernel)

        x = _residual(x, attend, self.attn_norm, self.dropout, self.post_norm)
        return _residual(x, self.ffn, self.ffn_norm, self.dropout, self.post_norm)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        _add_sublayers(self, config, config.decoder_shape, ("self_norm", "self_attn"), ("cross_norm", "cross_attn"))

    def forward(
        self,
        x: Tensor,
        self_mask: Tensor | None,
        cross_k: Tensor | KeysT,
        cross_v: Tensor,
        cross_mask: Tensor | None,
        kernel: AttentionKernel = EAGER,
        join_past: JoinPast | None = None,
    ) -> Tensor:
        """One block `x` [B, T, D] through the layer; `join_past` (None: the block attends only to
        itself) turns the block's self-attention K/V into the keys and values it attends over."""

        def self_attend(h: Tensor) -> Tensor:
            q, k, v = self.self_attn.project_qkv(h, kernel)
            if join_past is not None:
                k, v = join_past(k, v)
            return self.self_attn.attend_heads(q, k, v, self_mask, kernel)

        def cross_attend(h: Tensor) -> Tensor:
            return self.cross_attn.attend(h, cross_k, cross_v, cross_mask, kernel)

        x = _residual(x, self_attend, self.self_norm, self.dropout, self.post_norm)
        x = _residual(x, cross_attend, self.cross_norm, self.dropout, self.post_norm)
        return _residual(x, self.ffn, self.ffn_norm, self.dropout, self.post_norm)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, shape: StackShape) -> None:
        super().__init__()
        d, inner, bias = config.d_model, shape.attn_dim, config.linear_bias
        self.n_heads = shape.heads
        self.head_dim = shape.head_dim
        self.q_proj = nn.Linear(d, inner, bias=bias)
        self.k_proj = nn.Linear(d, inner, bias=bias)
        self.v_proj = nn.Linear(d, inner, bias=bias)
        self.out_proj = nn.Linear(inner, d, bias=bias)
        self.dropout_p = config.dropout

    def project_kv(self, x: Tensor, kernel: AttentionKernel = EAGER) -> tuple[Tensor, Tensor]:
        """K and V [B, H, T, hd] of the states `x` [B, T, D]."""
        k, v = kernel.project(x, (self.k_proj, self.v_proj))
        return self.split(k, kernel), self.split(v, kernel)

    def project_qkv(self, x: Tensor, kernel: AttentionKernel = EAGER) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K and V [B, H, T, hd] of the states `x` [B, T, D] (self-attention)."""
        q, k, v = kernel.project(x, (self.q_proj, self.k_proj, self.v_proj))
        return self.split(q, kernel), self.split(k, kernel), self.split(v, kernel)

    def attend(
        self, x: Tensor, k: Tensor | KeysT | Parts, v: Tensor | Parts, mask: Tensor | None,
        kernel: AttentionKernel = EAGER,
    ) -> Tensor:
        """The attention of the states `x` [B, T, D] over keys `k` and values `v` (cross-attention)."""
        return self.attend_heads(self.split(self.q_proj(x), kernel), k, v, mask, kernel)

    def attend_heads(
        self, q: Tensor, k: Tensor | KeysT | Parts, v: Tensor | Parts, mask: Tensor | None,
        kernel: AttentionKernel = EAGER,
    ) -> Tensor:
        """`attend` for queries already projected and split into heads [B, H, T, hd]."""
        p = self.dropout_p if self.training else 0.0
        out = kernel.attend(q, k, v, mask, self.head_dim, p)
        return self.out_proj(kernel.merge_heads(out, self.n_heads, self.head_dim))

    def split(self, x: Tensor, kernel: AttentionKernel) -> Tensor:
        """[B, T, H * hd] -> [B, H, T, hd] with this attention's heads."""
        return kernel.split_heads(x, self.n_heads, self.head_dim)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig, shape: StackShape) -> None:
        super().__init__()
        bias, width = config.linear_bias, shape.ffn_dim
        self.up = nn.Linear(config.d_model, width, bias=bias)
        # The gate's linear half (T5 v1.1's wi_1); `up` is the half the activation applies to.
        self.gate = nn.Linear(config.d_model, width, bias=bias) if config.gated_ffn else None
        self.down = nn.Linear(width, config.d_model, bias=bias)
        self.act = ACTIVATIONS[config.activation]
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.up(x))
        if self.gate is not None:
            h = h * self.gate(x)
        return self.down(self.dropout(h))


class RMSNorm(nn.Module):
    """T5's norm: scale by the root mean square, no mean subtraction, no bias; written in plain ops
    so the ONNX export needs no RMSNormalization operator."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


# The names are `seq2seq_models.config.ACTIVATIONS`; each is written as transformers' ACT2FN
# computes it, in ops the ONNX export has.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10.0, 10.0),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),
    "relu6": F.relu6,
    "leaky_relu": F.leaky_relu,
    "silu": F.silu,
    "mish": lambda x: x * torch.tanh(F.softplus(x)),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "hardswish": F.hardswish,
    "laplace": lambda x: 0.5 * (1.0 + torch.erf((x - 0.707107).div(0.282095 * math.sqrt(2.0)))),
    "sqrt_softplus": lambda x: F.softplus(x).sqrt(),
    "linear": lambda x: x,
}


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm_kind == "rms":
        return RMSNorm(config.d_model, config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps)


def _add_sublayers(layer: nn.Module, config: ModelConfig, shape: StackShape, *attentions: tuple[str, str]) -> None:
    """A layer's residual sublayers of its stack's `shape`, each after its norm: the attentions
    (named (norm, attention) as the checkpoints' weights are), then `ffn_norm`, `ffn`; and its
    `dropout` and `post_norm`."""
    layer.post_norm = config.norm_position == "post"
    for norm_name, attention_name in attentions:
        norm, attention = _normed(config, shape, Attention)
        setattr(layer, norm_name, norm)
        setattr(layer, attention_name, attention)
    layer.ffn_norm, layer.ffn = _normed(config, shape, FeedForward)
    layer.dropout = nn.Dropout(config.dropout)


def _normed(config: ModelConfig, shape: StackShape, sublayer: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
    """A sublayer and its norm (made in this order, so a seeded model's random init stays what it was)."""
    norm = make_norm(config)
    return norm, sublayer(config, shape)


def _residual(
    x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: nn.Module, dropout: nn.Module, post_norm: bool
) -> Tensor:
    """Pre-LN: x + f(norm(x)). Post-LN: norm(x + f(x))."""
    if post_norm:
        return norm(x + dropout(sublayer(x)))
    return x + dropout(sublayer(norm(x)))
