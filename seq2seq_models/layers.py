"""The Transformer's layers, each written once for every path that runs them.

Training, cached decoding and the ONNX export all call these same methods; what differs is passed
in: the attention kernel (`kernels.attention.EAGER` or `GRAPH`), the masks, the cross-attention
K/V, and for the decoder's self-attention how a block's K/V join the keys it attends over
(`JoinPast`: nothing for a whole target, the KV cache for incremental decoding, a concatenation
with the past for the exported graph). Dropout modules are identities in eval mode, and the
exporter drops them from the graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from kernels.attention import EAGER, AttentionKernel
from seq2seq_models.config import ModelConfig

# (block K, block V) [B, H, T, hd] -> the keys and values the block attends over [B, H, L, hd].
JoinPast = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = _pre_norm(config, Attention)
        self.ffn_norm, self.ffn = _pre_norm(config, FeedForward)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, mask: Tensor | None, kernel: AttentionKernel = EAGER) -> Tensor:
        h = self.attn_norm(x)
        k, v = self.attn.project_kv(h, kernel)
        x = x + self.dropout(self.attn.attend(h, k, v, mask, kernel))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_norm, self.self_attn = _pre_norm(config, Attention)
        self.cross_norm, self.cross_attn = _pre_norm(config, Attention)
        self.ffn_norm, self.ffn = _pre_norm(config, FeedForward)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: Tensor,
        self_mask: Tensor | None,
        cross_k: Tensor,
        cross_v: Tensor,
        cross_mask: Tensor | None,
        kernel: AttentionKernel = EAGER,
        join_past: JoinPast | None = None,
    ) -> Tensor:
        """One block `x` [B, T, D] through the layer; `join_past` (None: the block attends only to
        itself) turns the block's self-attention K/V into the keys and values it attends over."""
        h = self.self_norm(x)
        k, v = self.self_attn.project_kv(h, kernel)
        if join_past is not None:
            k, v = join_past(k, v)
        x = x + self.dropout(self.self_attn.attend(h, k, v, self_mask, kernel))
        x = x + self.dropout(self.cross_attn.attend(self.cross_norm(x), cross_k, cross_v, cross_mask, kernel))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.head_dim = d // config.n_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        self.dropout_p = config.dropout

    def project_kv(self, x: Tensor, kernel: AttentionKernel = EAGER) -> tuple[Tensor, Tensor]:
        """K and V [B, H, T, hd] of the states `x` [B, T, D]."""
        return self._split(self.k_proj(x), kernel), self._split(self.v_proj(x), kernel)

    def attend(
        self, x: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, kernel: AttentionKernel = EAGER
    ) -> Tensor:
        q = self._split(self.q_proj(x), kernel)
        p = self.dropout_p if self.training else 0.0
        out = kernel.attend(q, k, v, mask, self.head_dim, p)
        return self.out_proj(kernel.merge_heads(out, self.n_heads, self.head_dim))

    def _split(self, x: Tensor, kernel: AttentionKernel) -> Tensor:
        return kernel.split_heads(x, self.n_heads, self.head_dim)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.ffn_dim)
        self.down = nn.Linear(config.ffn_dim, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.dropout(F.gelu(self.up(x))))


def _pre_norm(config: ModelConfig, sublayer: type[nn.Module]) -> tuple[nn.LayerNorm, nn.Module]:
    """A pre-LN sublayer: its LayerNorm, then the sublayer (made in this order, so a seeded model's
    random init stays what it was)."""
    norm = nn.LayerNorm(config.d_model)
    return norm, sublayer(config)
