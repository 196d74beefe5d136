"""The attention kernels the model's layers run with: one for eager torch, two for ONNX export.

A kernel owns the three steps that differ between the paths: splitting a projection into heads,
the scaled dot-product attention itself, and merging the heads back. The layers
(`seq2seq_models.layers`) hold the rest of the math and take a kernel as a parameter, so the
eager model and the exported graphs share every other op.

* `EAGER`: `view` with the batch's own sizes and `F.scaled_dot_product_attention` (fused, with
  attention dropout while training).
* `GRAPH`: for tracing one sequence (batch 1): `reshape(1, -1, ...)`, so the traced length stays
  symbolic where `view(b, t, ...)` would freeze it as a constant, and plain matmul-softmax, which
  exports to standard ops that ONNX Runtime fuses on its own.
* `BATCHED`: `GRAPH` for tracing a ragged batch (`seq2seq_models.batch_graph`): the batch and the
  block length both stay symbolic (the head split reshapes with the traced sizes of the input,
  the merge flattens the last two axes), with the same matmul-softmax.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["BATCHED", "EAGER", "GRAPH", "AttentionKernel", "BatchedGraphAttention", "EagerAttention", "GraphAttention"]


class AttentionKernel(Protocol):
    def split_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        """[B, T, H * hd] -> [B, H, T, hd]."""
        ...

    def merge_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        """[B, H, T, hd] -> [B, T, H * hd]."""
        ...

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, head_dim: int, dropout_p: float
    ) -> Tensor:
        """softmax(q kᵀ / sqrt(hd)) v over the keys `mask` allows (True = may attend; None = all); a
        float `mask` is added to the scores instead (relative position bias, -inf = not allowed)."""
        ...


class EagerAttention:
    def split_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n_heads, head_dim).transpose(1, 2)

    def merge_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        b, _, t, _ = x.shape
        return x.transpose(1, 2).reshape(b, t, -1)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, head_dim: int, dropout_p: float
    ) -> Tensor:
        # SDPA's own default scale: an explicit one takes another route in its math kernel.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class GraphAttention:
    def split_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        return x.reshape(1, -1, n_heads, head_dim).transpose(1, 2)

    def merge_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        return x.transpose(1, 2).reshape(1, -1, n_heads * head_dim)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, head_dim: int, dropout_p: float
    ) -> Tensor:
        if dropout_p:
            raise ValueError("the graph kernel is for exporting a model in eval mode (no attention dropout)")
        # head_dim is a Python int, so the scale is a constant in the graph rather than a traced size.
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(head_dim))
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:  # an additive mask: relative position bias, -inf where not allowed
            scores = scores + mask
        return torch.matmul(torch.softmax(scores, dim=-1), v)


class BatchedGraphAttention(GraphAttention):
    """`GRAPH` with a symbolic batch axis: sizes come from the traced input's shape, never from
    Python ints, so one exported graph serves any batch and block length."""

    def split_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        return x.unflatten(-1, (n_heads, head_dim)).transpose(1, 2)

    def merge_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        return x.transpose(1, 2).flatten(2)


EAGER: AttentionKernel = EagerAttention()
GRAPH: AttentionKernel = GraphAttention()
BATCHED: AttentionKernel = BatchedGraphAttention()
