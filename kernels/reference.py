"""Plain torch reference of the verifier's output head.

Contract shared by every version of the head (reference, CPU, Triton):

    output_head(hidden [R, D], weight [V, D], bias [V] | None, k, targets [R] long, processing=None)
        -> HeadOutput(topk_ids [R, k] long, topk_logprobs [R, k], target_logprobs [R])

`targets[r]` is the drafted token whose log-prob row r must report, or -1 for "none" (its
log-prob is then NaN). Top-k is sorted by descending log-prob; ties go to the lower id.
Log-probs are in the dtype of `hidden`.

`processing` (`core.logits_processors.Processing`, numpy arrays): the logits processors of each row.
A row in logit space has its logits processed, then normalised (the log-probs greedy search's
processed logits give); a row in log-prob space (beam search) has its log-softmax processed and
left unnormalised, as `generate()` ranks them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from core.logits_processors import Processing, apply_processing


@dataclass(frozen=True)
class HeadOutput:
    topk_ids: Tensor  # [R, k] long
    topk_logprobs: Tensor  # [R, k]
    target_logprobs: Tensor  # [R], NaN where the target was -1


def output_head_reference(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, k: int, targets: Tensor, processing: Processing | None = None,
) -> HeadOutput:
    logits = F.linear(hidden, weight, bias)
    logprobs = processed_logprobs(logits, processing) if acts(processing) else F.log_softmax(logits, dim=-1)
    k = min(k, logprobs.shape[-1])
    topk_lp, topk_ids = _topk_lowest_id_first(logprobs, k)
    has_target = targets >= 0
    gathered = logprobs.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    target_lp = torch.where(has_target, gathered, torch.full_like(gathered, float("nan")))
    return HeadOutput(topk_ids=topk_ids, topk_logprobs=topk_lp, target_logprobs=target_lp)


def acts(processing: Processing | None) -> bool:
    """Whether `processing` changes any score (else a head runs as without it, bit for bit)."""
    return processing is not None and processing.acts


def processed_logprobs(logits: Tensor, processing: Processing) -> Tensor:
    """The log-probs of `logits` [R, V] (a buffer the caller gives up) after each row's processors."""
    device, dtype = logits.device, logits.dtype
    p = processing.map(lambda a: torch.from_numpy(a).to(device, dtype if a.dtype.kind == "f" else None))
    rows = p.logprob_rows
    if processing.any_logprob_space:
        logits[rows] = F.log_softmax(logits[rows], dim=-1)
    apply_processing(logits, p)
    logprobs = F.log_softmax(logits, dim=-1)
    if processing.any_logprob_space:
        logprobs[rows] = logits[rows]
    return logprobs


def _topk_lowest_id_first(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    # A stable descending sort makes ties deterministic (lower id first), which torch.topk
    # does not promise; the head is small enough that the full sort is not the bottleneck here.
    sorted_vals, sorted_ids = torch.sort(values, dim=-1, descending=True, stable=True)
    return sorted_vals[:, :k], sorted_ids[:, :k]
