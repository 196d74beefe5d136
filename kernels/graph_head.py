"""The output head as the ONNX export traces it (same contract as `kernels.reference`).

The verifier's exported decoder ends in this head, so a step is one ONNX Runtime call and only
the top-k rows cross back to Python. It is written for tracing: `k` may be a tensor (a graph
input), and every op maps to one standard ONNX op (MatMul/Add, LogSoftmax, TopK, GatherElements,
Where). ONNX TopK breaks ties by lower index, as the contract asks; in eager torch, `torch.topk`
does not promise that, so outside a graph use `output_head` instead. Unlike the other versions
it does not clip `k` to the vocabulary (the graph's callers check `k` first).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.reference import HeadOutput

__all__ = ["output_head_graph"]


def output_head_graph(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, k: int | Tensor, targets: Tensor,
    processing: Sequence[Tensor] | None = None, logit_space_only: bool = False,
) -> HeadOutput:
    """hidden [R, D], weight [V, D], bias [V] | None, targets [R] (-1 = none) -> top-k and target log-probs.
    `processing`: the rows' logits processors as the tensors `core.logits_processors.PROCESSING_INPUTS`
    name (empty index arrays: none), applied as `kernels.reference` applies them; an ONNX If skips
    them where no plan changes a score (a subgraph's run has a fixed cost of its own).
    `logit_space_only`: the caller never sends rows in log-prob space (beam search's) and
    `processing` is LOGIT_PROCESSING_INPUTS' tensors (no logprob_rows): the processors run without
    a branch (`_processed_logits`), a few cheap passes whether or not any plan changes a score."""
    logits = F.linear(hidden, weight, bias)
    if processing is None:
        logprobs = F.log_softmax(logits, dim=-1)
    elif logit_space_only:  # `processing` without logprob_rows (LOGIT_PROCESSING_INPUTS)
        logprobs = _processed_logits(logits, *processing)
    else:
        logprobs = _processed_if_any(logits, *processing)
    topk_lp, topk_ids = torch.topk(logprobs, k, dim=-1)
    gathered = logprobs.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    target_lp = torch.where(targets >= 0, gathered, torch.full_like(gathered, float("nan")))
    return HeadOutput(topk_ids=topk_ids, topk_logprobs=topk_lp, target_logprobs=target_lp)


def _processed_logits(
    logits: Tensor, penalty_rows: Tensor, penalty_ids: Tensor, penalty_factors: Tensor, ban_rows: Tensor,
    ban_ids: Tensor, forced_rows: Tensor, forced_ids: Tensor,
) -> Tensor:
    """`_processed` (below) where every row is in logit space (greedy search and the lossless modes:
    the common case), without a branch: `_applied`, then one LogSoftmax."""
    return F.log_softmax(
        _applied(logits, penalty_rows, penalty_ids, penalty_factors, ban_rows, ban_ids, forced_rows, forced_ids),
        dim=-1)


def _processed(
    logits: Tensor, logprob_rows: Tensor, penalty_rows: Tensor, penalty_ids: Tensor,
    penalty_factors: Tensor, ban_rows: Tensor, ban_ids: Tensor, forced_rows: Tensor, forced_ids: Tensor,
) -> Tensor:
    """`core.logits_processors.apply_processing` where some rows are in log-prob space (beam
    search's): those rows' scores are their log-probs, processed and left unnormalised; the
    logit-space rows' are normalised after `_applied`."""
    in_logprobs = logprob_rows[:, None]
    scores = _applied(torch.where(in_logprobs, F.log_softmax(logits, dim=-1), logits), penalty_rows, penalty_ids,
                      penalty_factors, ban_rows, ban_ids, forced_rows, forced_ids)
    return torch.where(in_logprobs, scores, F.log_softmax(scores, dim=-1))


def _applied(
    scores: Tensor, penalty_rows: Tensor, penalty_ids: Tensor, penalty_factors: Tensor, ban_rows: Tensor,
    ban_ids: Tensor, forced_rows: Tensor, forced_ids: Tensor,
) -> Tensor:
    """The plans applied to `scores` [R, V] in few cheap passes (a broadcast Where over them costs
    several Subs): a forced row is its scores plus -inf (one broadcast Add, 0 for the other rows),
    then the penalty, the bans and each forced id's 0 are one ScatterElements on the flattened
    scores (row * V + id; `core.logits_processors.RowPlan`: no id is both penalised and banned, and a
    forced row has neither, so no two writes meet)."""
    rows, vocab = scores.shape[0], scores.shape[1]
    column = scores[:, 0]
    minus_inf = torch.full_like(forced_rows, float("-inf"), dtype=scores.dtype)
    flat = (scores + torch.zeros_like(column).scatter(0, forced_rows, minus_inf)[:, None]).reshape(-1)
    at = penalty_rows * vocab + penalty_ids
    values = flat.index_select(0, at)
    scaled = torch.where(values < 0, values * penalty_factors, values / penalty_factors)
    banned = torch.full_like(ban_rows, float("-inf"), dtype=flat.dtype)
    forced = torch.zeros_like(forced_rows, dtype=flat.dtype)
    writes = torch.cat([at, ban_rows * vocab + ban_ids, forced_rows * vocab + forced_ids])
    return flat.scatter(0, writes, torch.cat([scaled, banned, forced])).reshape(rows, vocab)


def _processed_if_any(
    logits: Tensor, logprob_rows: Tensor, penalty_rows: Tensor, penalty_ids: Tensor,
    penalty_factors: Tensor, ban_rows: Tensor, ban_ids: Tensor, forced_rows: Tensor, forced_ids: Tensor,
) -> Tensor:
    """The log-probs of `logits`, through `_processed` / `_processed_logits` (above) where a plan
    changes a score.
    Scripted (below), so that the traced graph keeps the branch as an ONNX If: a forward without
    processors skips their ops."""
    if penalty_rows.numel() + ban_rows.numel() + forced_rows.numel() > 0:
        if bool(logprob_rows.any()):
            return _processed(logits, logprob_rows, penalty_rows, penalty_ids, penalty_factors, ban_rows,
                              ban_ids, forced_rows, forced_ids)
        return _processed_logits(logits, penalty_rows, penalty_ids, penalty_factors, ban_rows, ban_ids,
                                 forced_rows, forced_ids)
    return F.log_softmax(logits, dim=-1)


with warnings.catch_warnings():
    # TorchScript is deprecated, but the exporter this graph is traced by (dynamo=False) is TorchScript too.
    warnings.simplefilter("ignore", DeprecationWarning)
    _processed_if_any = torch.jit.script(_processed_if_any)
