"""The output head as the ONNX export traces it (same contract as `kernels.reference`).

The verifier's exported decoder ends in this head, so a step is one ONNX Runtime call and only
the top-k rows cross back to Python. It is written for tracing: `k` may be a tensor (a graph
input), and every op maps to one standard ONNX op (MatMul/Add, LogSoftmax, TopK, GatherElements,
Where). ONNX TopK breaks ties by lower index, as the contract asks; in eager torch, `torch.topk`
does not promise that, so outside a graph use `output_head` instead. Unlike the other versions
it does not clip `k` to the vocabulary (the graph's callers check `k` first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.reference import HeadOutput

__all__ = ["output_head_graph"]


def output_head_graph(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, k: int | Tensor, targets: Tensor
) -> HeadOutput:
    """hidden [R, D], weight [V, D], bias [V] | None, targets [R] (-1 = none) -> top-k and target log-probs."""
    logprobs = F.log_softmax(F.linear(hidden, weight, bias), dim=-1)
    topk_lp, topk_ids = torch.topk(logprobs, k, dim=-1)
    gathered = logprobs.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    target_lp = torch.where(targets >= 0, gathered, torch.full_like(gathered, float("nan")))
    return HeadOutput(topk_ids=topk_ids, topk_logprobs=topk_lp, target_logprobs=target_lp)
