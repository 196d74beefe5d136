"""Fast CPU version of the output head (same contract as `kernels.reference`).

The projection h·Wᵀ is most of the head's time, and `F.linear` lands in MKL, which runs the
one-row case as a single-threaded GEMV and small-M GEMMs well below peak. oneDNN's matmul
(`torch.ops.mkldnn._linear_pointwise`, the op Inductor emits for CPU linears, bias fused) is faster
for 1..32 rows, so fp32 goes there; other dtypes and builds without it use F.linear.

The epilogue is kept to ops that are single fused kernels in ATen: an in-place log-softmax over
the fresh logits buffer (no second [R, V] tensor), one `topk`, one `gather`. Top-k on raw logits
plus `torch.logsumexp` (an unfused multi-pass op) and a chunked pass over the vocabulary with an
online log-sum-exp (per-chunk dispatcher overhead and smaller GEMMs cost more than the cache
locality saves) were both slower. Figures: BENCHMARKS.md, "Fused output head (CPU)" and "Fused
output head: notes".
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from core.logits_processors import Processing
from kernels.reference import HeadOutput, acts, processed_logprobs

__all__ = ["output_head_cpu", "topk_lowest_id_first"]


def output_head_cpu(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, k: int, targets: Tensor, processing: Processing | None = None,
) -> HeadOutput:
    """Top-k ids/log-probs and the targets' log-probs for each row of `hidden`; see the reference
    (`processing`: the rows' logits processors)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    with torch.no_grad():
        logprobs = _project(hidden, weight, bias)
        if acts(processing):
            assert processing is not None
            logprobs = processed_logprobs(logprobs, processing)
        else:
            # The buffer is ours alone, so the log-softmax can overwrite it (bitwise equal to
            # F.log_softmax; the kernel finishes each row's max and sum before writing it).
            torch._log_softmax(logprobs, 1, False, out=logprobs)
        topk_lp, topk_ids = topk_lowest_id_first(logprobs, min(k, logprobs.shape[1]))
        target_lp = _gather_targets(logprobs, targets)
    return HeadOutput(topk_ids=topk_ids, topk_logprobs=topk_lp, target_logprobs=target_lp)


def _project(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Logits [R, V] in a fresh buffer, with the fastest GEMM this build has for the dtype."""
    # Cheap checks first: at one row the whole head is so cheap (BENCHMARKS.md, "Fused output head
    # (CPU)") that a few microseconds of Python matter.
    if (
        hidden.dtype is torch.float32
        and weight.dtype is torch.float32
        and (bias is None or bias.dtype is torch.float32)
        and hidden.is_cpu
        and weight.is_cpu
        and _onednn_linear_ok()
    ):
        return torch.ops.mkldnn._linear_pointwise(hidden, weight, bias, "none", [], "")
    return F.linear(hidden, weight, bias)


@functools.cache
def _onednn_linear_ok() -> bool:
    # The op is private to Inductor: probe it once and fall back to F.linear if this build lacks
    # it (non-oneDNN builds) or it misbehaves.
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(3, 40, generator=gen)
        w = torch.randn(9, 40, generator=gen)
        b = torch.randn(9, generator=gen)
        got = torch.ops.mkldnn._linear_pointwise(h, w, b, "none", [], "")
        return bool(torch.allclose(got, F.linear(h, w, b), atol=1e-4, rtol=1e-4))
    except (AttributeError, RuntimeError):
        return False


def topk_lowest_id_first(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k sorted descending, ties to the lower id, without a full sort.

    torch.topk orders exact ties arbitrarily. Asking for k+1 shows whether any row has a tie inside
    its top k or across the k boundary (values not strictly decreasing; NaNs count too); only such
    rows, rare with real logits, take the slower exact path.
    """
    probe = min(k + 1, values.shape[1])
    vals, ids = torch.topk(values, probe, dim=1)
    if _strictly_decreasing(vals):
        return vals[:, :k], ids[:, :k]
    tied_rows = (~(vals[:, :-1] > vals[:, 1:]).all(dim=1)).nonzero()[:, 0]
    vals, ids = vals[:, :k].clone(), ids[:, :k].clone()
    vals[tied_rows], ids[tied_rows] = _fix_ties(values[tied_rows], vals[tied_rows], ids[tied_rows])
    return vals, ids


def _strictly_decreasing(vals: Tensor) -> bool:
    if vals.numel() <= 48:
        # At a few rows the head's cost is mostly per-op overhead: one tolist() and a Python loop
        # beat three dispatcher calls (slices, compare, all) there.
        return all(a > b for row in vals.tolist() for a, b in itertools.pairwise(row))
    return bool((vals[:, :-1] > vals[:, 1:]).all())


def _fix_ties(values: Tensor, vals: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Exact top-k for rows with ties: everything above the k-th value, plus the lowest ids equal to it."""
    k, vocab = vals.shape[1], values.shape[1]
    kth = vals[:, -1:]
    # Candidates equal to the k-th value: the k lowest ids among them (id `vocab` = no such entry).
    positions = torch.arange(vocab, device=values.device).expand_as(values)
    eq_ids = torch.where(_same(values, kth), positions, torch.full_like(positions, vocab))
    eq_ids = eq_ids.topk(min(k, vocab), dim=1, largest=False).values
    eq_valid = eq_ids < vocab
    above = ~_same(vals, kth)  # all strictly-above entries are already in torch's top k
    cand_vals = torch.cat([vals, kth.expand(-1, eq_ids.shape[1])], dim=1)
    cand_ids = torch.cat([ids, eq_ids.clamp(max=vocab - 1)], dim=1)
    valid = torch.cat([above, eq_valid], dim=1)
    # Order by (valid first, value descending, id ascending) with three stable sorts, last key first.
    order = cand_ids.argsort(dim=1, stable=True)
    order = order.gather(1, cand_vals.gather(1, order).argsort(dim=1, descending=True, stable=True))
    order = order.gather(1, (~valid).gather(1, order).to(torch.uint8).argsort(dim=1, stable=True))
    order = order[:, :k]
    return cand_vals.gather(1, order), cand_ids.gather(1, order)


def _same(a: Tensor, b: Tensor) -> Tensor:
    # NaN counts as equal to NaN: torch.sort puts NaNs first, so they tie like any equal values.
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


def _gather_targets(logprobs: Tensor, targets: Tensor) -> Tensor:
    # At a few rows the clamp and mask ops are a measurable share of the whole head: when every
    # row has a target, or none has (a greedy step), one look at the list skips them.
    if targets.numel() <= 64:
        listed = targets.tolist()
        if min(listed, default=0) >= 0:
            return logprobs.gather(1, targets.view(-1, 1)).view(-1)
        if max(listed) < 0:
            return torch.full((len(listed),), float("nan"), dtype=logprobs.dtype, device=logprobs.device)
    gathered = logprobs.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return gathered.masked_fill_(targets < 0, float("nan"))
