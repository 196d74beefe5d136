"""Multi-step greedy decoding where the model is (`VerifyStep.greedy_steps`).

The AR baseline commits one token per step, so over gRPC it paid one round trip per token. With
`greedy_steps = m` the verifier runs up to m plain AR steps back to back, appending its own top1
after each, and answers once: the same steps in the same order (each still batched with other
sessions' steps), without the client in the loop. `greedy_next` is the one rule both the
in-process session and the verifier service's scheduler follow.
"""

from __future__ import annotations

from core.errors import invalid
from core.interfaces import StepCall, VerifyResult


def greedy_next(
    call: StepCall, result: VerifyResult, steps_run: int, steps: int, eos_id: int, max_output_len: int
) -> StepCall | None:
    """After `steps_run` of `steps` greedy steps, `call` the last one and `result` its answer: the
    next step (its top1 appended as final, nothing drafted), or None when the run ends: all steps
    ran, the top1 is EOS (the client cuts there), or appending it would fill the session."""
    token = result.top1[-1]
    if steps_run >= steps or token == eos_id:
        return None
    committed = call.committed_len + len(call.append_ids)
    if committed + 1 > max_output_len:
        return None
    return StepCall(committed, [token], [], call.top_k)


def check_greedy_steps(steps: int, call: StepCall) -> None:
    """A VerifyStep's greedy_steps: 0 or 1 is one plain step; more only for a single-row step
    with no draft (a draft's positions and the greedy tokens would not be one sequence)."""
    if steps < 0:
        raise invalid(f"greedy_steps must be >= 0, got {steps}")
    if steps > 1 and (call.rows is not None or call.draft_ids):
        raise invalid("greedy_steps > 1 needs a single-row step with empty draft_ids")


def merge_greedy(results: list[VerifyResult]) -> VerifyResult:
    """The single-position results of a greedy run as one result, a position per step (the load
    figures: the last step's forward)."""
    last = results[-1]
    return VerifyResult(
        top1=[r.top1[0] for r in results],
        topk_ids=[r.topk_ids[0] if r.topk_ids else [] for r in results],
        topk_logprobs=[r.topk_logprobs[0] if r.topk_logprobs else [] for r in results],
        draft_logprobs=[],
        batch_rows=last.batch_rows,
        batch_tokens=last.batch_tokens,
        forward_s=last.forward_s,
    )
