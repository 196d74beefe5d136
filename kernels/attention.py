"""The attention kernels the model's layers run with: one for eager torch, two for ONNX export.

A kernel owns the three steps that differ between the paths: splitting a projection into heads,
the scaled dot-product attention itself, and merging the heads back. The layers
(`seq2seq_models.layers`) hold the rest of the math and take a kernel as a parameter, so the
eager model and the exported graphs share every other op.

* `EAGER`: `view` with the batch's own sizes and `F.scaled_dot_product_attention` (fused, with
  attention dropout while training); each projection its own linear.
* `GRAPH`: for tracing one sequence (batch 1): `reshape(1, -1, ...)`, so the traced length stays
  symbolic where `view(b, t, ...)` would freeze it as a constant, and plain matmul-softmax, which
  exports to standard ops that ONNX Runtime fuses on its own.
* `BATCHED`: `GRAPH` for tracing a ragged batch (`seq2seq_models.batch_graph`): the batch and the
  block length both stay symbolic (the head split reshapes with the traced sizes of the input,
  the merge flattens the last two axes), with the same matmul-softmax.
* `STEP`: `BATCHED` for a batch of one-token blocks (AR steps): fewer and cheaper ops where a block
  is one token (`StepAttention`).

The graph kernels also project the input of several linears in one matmul (`project`: self-attention's
Q, K and V; every decoder layer's cross-attention K and V of the encoder output), so an int8 export
quantizes that input once and runs one wide GEMM (`seq2seq_models.onnx_quantize`); the weights are
joined while tracing, so the exported graph holds them as one matrix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BATCHED", "EAGER", "GRAPH", "STEP", "AttentionKernel", "BatchedGraphAttention", "EagerAttention",
    "GraphAttention", "KeysT", "Parts", "StepAttention",
]


class KeysT(NamedTuple):
    """Keys stored transposed, `t` [B, H, hd, L]: the layout of the K/V pools' keys
    (`seq2seq_models.row_cache.KVPool`), so that the scores are a plain matmul by them; by keys
    [B, H, L, hd] a matmul must transpose each row's keys first, which costs most of it when each
    query is one row (BENCHMARKS.md, "Bulk decoding: notes")."""

    t: Tensor

    def keys(self) -> Tensor:
        """[B, H, L, hd]."""
        return self.t.transpose(-1, -2)


class Parts(NamedTuple):
    """Keys (or values) [B, H, *, hd] in two parts, a row's cached past and its new block, attended
    over as one sequence (past first); a past of keys may be `KeysT`. The batched graph passes them
    apart: joining them would copy every row's whole past at every step and layer, the largest cost of
    a batched forward on a CPU (BENCHMARKS.md, "Bulk decoding: notes")."""

    past: Tensor | KeysT
    block: Tensor

    def joined(self) -> Tensor:
        return torch.cat([_plain(self.past), self.block], dim=2)


class AttentionKernel(Protocol):
    def project(self, x: Tensor, linears: Sequence[nn.Linear]) -> list[Tensor]:
        """Each linear applied to `x`, in order."""
        ...

    def split_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        """[B, T, H * hd] -> [B, H, T, hd]."""
        ...

    def merge_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        """[B, H, T, hd] -> [B, T, H * hd]."""
        ...

    def attend(
        self, q: Tensor, k: Tensor | KeysT | Parts, v: Tensor | Parts, mask: Tensor | None, head_dim: int,
        dropout_p: float,
    ) -> Tensor:
        """softmax(q kᵀ / sqrt(hd)) v over the keys `mask` allows (True = may attend; None = all); a
        float `mask` is added to the scores instead (relative position bias, -inf = not allowed).
        Keys may be `KeysT`; keys and values may come in `Parts` (past, block)."""
        ...


class EagerAttention:
    def project(self, x: Tensor, linears: Sequence[nn.Linear]) -> list[Tensor]:
        return [linear(x) for linear in linears]

    def split_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n_heads, head_dim).transpose(1, 2)

    def merge_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        b, _, t, _ = x.shape
        return x.transpose(1, 2).reshape(b, t, -1)

    def attend(
        self, q: Tensor, k: Tensor | KeysT | Parts, v: Tensor | Parts, mask: Tensor | None, head_dim: int,
        dropout_p: float,
    ) -> Tensor:
        k, v = _joined(k), _joined(v)
        # SDPA's own default scale: an explicit one takes another route in its math kernel.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class GraphAttention:
    def project(self, x: Tensor, linears: Sequence[nn.Linear]) -> list[Tensor]:
        if len(linears) == 1:
            return [linears[0](x)]
        weight = torch.cat([linear.weight for linear in linears])
        biases = [linear.bias for linear in linears]
        bias = None if any(b is None for b in biases) else torch.cat(biases)
        if bias is None and any(b is not None for b in biases):  # some have one: the others' are zero
            bias = torch.cat([b if b is not None else linear.weight.new_zeros(linear.out_features)
                              for b, linear in zip(biases, linears, strict=True)])
        return list(F.linear(x, weight, bias).split([linear.out_features for linear in linears], dim=-1))

    def split_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        return x.reshape(1, -1, n_heads, head_dim).transpose(1, 2)

    def merge_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        return x.transpose(1, 2).reshape(1, -1, n_heads * head_dim)

    def attend(
        self, q: Tensor, k: Tensor | KeysT | Parts, v: Tensor | Parts, mask: Tensor | None, head_dim: int,
        dropout_p: float,
    ) -> Tensor:
        if dropout_p:
            raise ValueError("the graph kernel is for exporting a model in eval mode (no attention dropout)")
        # head_dim is a Python int, so the scale is a constant in the graph rather than a traced size.
        scale = 1.0 / math.sqrt(head_dim)
        if isinstance(k, Parts):  # scores of both parts side by side: small next to the keys
            scores = torch.cat([_scores(q, k.past), _scores(q, k.block)], dim=-1) * scale
        else:
            scores = _scores(q, k) * scale
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:  # an additive mask: relative position bias, -inf where not allowed
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        if isinstance(v, Parts):
            past = v.past.shape[2]
            return torch.matmul(weights[..., :past], v.past) + torch.matmul(weights[..., past:], v.block)
        return torch.matmul(weights, v)


class BatchedGraphAttention(GraphAttention):
    """`GRAPH` with a symbolic batch axis: sizes come from the traced input's shape, never from
    Python ints, so one exported graph serves any batch and block length."""

    def split_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        return x.unflatten(-1, (n_heads, head_dim)).transpose(1, 2)

    def merge_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        return x.transpose(1, 2).flatten(2)


class StepAttention(BatchedGraphAttention):
    """`BATCHED` for tracing a batch of one-token blocks (AR steps): with one query a row, splitting
    into heads and merging them back are reshapes (no transposes), and the query's score against its
    own key is a product summed over the head (no matmul of one by one per row and head). The
    graph it makes serves blocks of one token only (`decoder_step.onnx`)."""

    def split_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        return x.reshape(-1, n_heads, 1, head_dim)

    def merge_heads(self, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
        return x.reshape(-1, 1, n_heads * head_dim)

    def attend(
        self, q: Tensor, k: Tensor | KeysT | Parts, v: Tensor | Parts, mask: Tensor | None, head_dim: int,
        dropout_p: float,
    ) -> Tensor:
        if not isinstance(k, Parts) or not isinstance(v, Parts):
            return super().attend(q, k, v, mask, head_dim, dropout_p)
        if dropout_p:
            raise ValueError("the graph kernel is for exporting a model in eval mode (no attention dropout)")
        scale = 1.0 / math.sqrt(head_dim)
        own = (q * k.block).sum(-1, keepdim=True)  # [B, H, 1, 1]
        scores = torch.cat([_scores(q, k.past), own], dim=-1) * scale
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        past = v.past.shape[2]
        return torch.matmul(weights[..., :past], v.past) + weights[..., past:] * v.block


def _scores(q: Tensor, k: Tensor | KeysT) -> Tensor:
    """q kᵀ: by keys stored transposed, a plain matmul."""
    return torch.matmul(q, k.t) if isinstance(k, KeysT) else torch.matmul(q, k.transpose(-1, -2))


def _plain(k: Tensor | KeysT) -> Tensor:
    return k.keys() if isinstance(k, KeysT) else k


def _joined(x: Tensor | KeysT | Parts) -> Tensor:
    return x.joined() if isinstance(x, Parts) else _plain(x)


EAGER: AttentionKernel = EagerAttention()
GRAPH: AttentionKernel = GraphAttention()
STEP: AttentionKernel = StepAttention()
BATCHED: AttentionKernel = BatchedGraphAttention()
