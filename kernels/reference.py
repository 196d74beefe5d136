"""Plain torch reference of the verifier's output head.

Contract shared by every version of the head (reference, CPU, Triton):

    output_head(hidden [R, D], weight [V, D], bias [V] | None, k, targets [R] long)
        -> HeadOutput(topk_ids [R, k] long, topk_logprobs [R, k], target_logprobs [R])

`targets[r]` is the drafted token whose log-prob row r must report, or -1 for "none" (its
log-prob is then NaN). Top-k is sorted by descending log-prob; ties go to the lower id.
Log-probs are in the dtype of `hidden`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class HeadOutput:
    topk_ids: Tensor  # [R, k] long
    topk_logprobs: Tensor  # [R, k]
    target_logprobs: Tensor  # [R], NaN where the target was -1


def output_head_reference(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, k: int, targets: Tensor
) -> HeadOutput:
    logprobs = F.log_softmax(F.linear(hidden, weight, bias), dim=-1)
    k = min(k, logprobs.shape[-1])
    topk_lp, topk_ids = _topk_lowest_id_first(logprobs, k)
    has_target = targets >= 0
    gathered = logprobs.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    target_lp = torch.where(has_target, gathered, torch.full_like(gathered, float("nan")))
    return HeadOutput(topk_ids=topk_ids, topk_logprobs=topk_lp, target_logprobs=target_lp)


def _topk_lowest_id_first(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    # A stable descending sort makes ties deterministic (lower id first), which torch.topk
    # does not promise; the head is small enough that the full sort is not the bottleneck here.
    sorted_vals, sorted_ids = torch.sort(values, dim=-1, descending=True, stable=True)
    return sorted_vals[:, :k], sorted_ids[:, :k]
