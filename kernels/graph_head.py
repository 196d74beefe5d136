"""The output head as the ONNX export traces it (same contract as `kernels.reference`).

The verifier's exported decoder ends in this head, so a step is one ONNX Runtime call and only
the top-k rows cross back to Python. It is written for tracing: `k` may be a tensor (a graph
input), and every op maps to one standard ONNX op (MatMul/Add, LogSoftmax, TopK, GatherElements,
Where). ONNX TopK breaks ties by lower index, as the contract asks; in eager torch, `torch.topk`
does not promise that, so outside a graph use `output_head` instead. Unlike the other versions
it does not clip `k` to the vocabulary (the graph's callers check `k` first).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.reference import HeadOutput

__all__ = ["output_head_graph"]


def output_head_graph(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, k: int | Tensor, targets: Tensor,
    processing: Sequence[Tensor] | None = None,
) -> HeadOutput:
    """hidden [R, D], weight [V, D], bias [V] | None, targets [R] (-1 = none) -> top-k and target log-probs.
    `processing`: the rows' logits processors as the tensors `core.logits_processors.PROCESSING_INPUTS`
    name (empty index arrays: none), applied as `kernels.reference` applies them."""
    logits = F.linear(hidden, weight, bias)
    logprobs = F.log_softmax(logits, dim=-1)
    if processing is not None:
        logprobs = _processed(logits, logprobs, *processing)
    topk_lp, topk_ids = torch.topk(logprobs, k, dim=-1)
    gathered = logprobs.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    target_lp = torch.where(targets >= 0, gathered, torch.full_like(gathered, float("nan")))
    return HeadOutput(topk_ids=topk_ids, topk_logprobs=topk_lp, target_logprobs=target_lp)


def _processed(
    logits: Tensor, logprobs: Tensor, logprob_rows: Tensor, penalty_rows: Tensor, penalty_ids: Tensor,
    penalty_factors: Tensor, ban_rows: Tensor, ban_ids: Tensor, forced_rows: Tensor, forced_ids: Tensor,
) -> Tensor:
    """`core.logits_processors.apply_processing` in standard ops (Where, Gather, ScatterElements on
    the flattened scores: row * V + id), then the logit-space rows normalised."""
    rows, vocab = logits.shape[0], logits.shape[1]
    in_logprobs = logprob_rows[:, None]
    flat = torch.where(in_logprobs, logprobs, logits).reshape(-1)
    at = penalty_rows * vocab + penalty_ids
    values = flat.index_select(0, at)
    flat = flat.scatter(0, at, torch.where(values < 0, values * penalty_factors, values / penalty_factors))
    flat = flat.scatter(0, ban_rows * vocab + ban_ids, torch.full_like(ban_rows, float("-inf"), dtype=flat.dtype))
    forced = torch.zeros_like(logprob_rows, dtype=flat.dtype).scatter(
        0, forced_rows, torch.ones_like(forced_rows, dtype=flat.dtype)) > 0
    scores = torch.where(forced[:, None], torch.full_like(logits, float("-inf")), flat.reshape(rows, vocab))
    flat = scores.reshape(-1).scatter(0, forced_rows * vocab + forced_ids, torch.zeros_like(forced_rows,
                                                                                           dtype=flat.dtype))
    scores = flat.reshape(rows, vocab)
    return torch.where(in_logprobs, scores, F.log_softmax(scores, dim=-1))
