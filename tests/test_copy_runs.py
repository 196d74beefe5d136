"""IAD run where the model is (`core.copy_draft.CopyRun`): a copy-drafted greedy run gives the tokens
of the same plain greedy steps, and says what each forward drafted and kept; checked against a
deterministic next-token rule standing in for a model's top-1 (the rule, not a service, is under test)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.copy_draft import CopyDrafter, CopyRun, check_copy_draft
from core.errors import SpecdecError, StatusCode
from core.interfaces import StepCall, VerifyResult

BOS, EOS = 1, 2


def model_for(source: list[int], edits: dict[int, int], length: int):
    """A top-1 rule that copies `source` with tokens replaced at the positions in `edits`, and ends
    with EOS after `length` tokens."""
    target = [*[edits.get(i, t) for i, t in enumerate(source)][:length], EOS]

    def top1(prefix: list[int]) -> int:
        return target[len(prefix)] if len(prefix) < len(target) else EOS

    return top1


def verify(top1, held: list[int], call: StepCall) -> VerifyResult:
    """What a verifier answers for `call` after `held` final tokens: a top-1 per drafted position
    and one past the draft."""
    seq = [*held[: call.committed_len], *call.append_ids]
    out = [top1(seq + call.draft_ids[:i]) for i in range(len(call.draft_ids) + 1)]
    return VerifyResult(top1=out, topk_ids=[[t] for t in out], topk_logprobs=[[0.0] for _ in out], draft_logprobs=[])


def run(top1, source: list[int], prefix: list[int], steps: int, k: int, room: int) -> CopyRun:
    """A whole copy run after `prefix` (held as final, the last token appended by the run's first
    step), each step verified as the rule says; the session's tokens follow its steps."""
    copy_run = CopyRun(CopyDrafter(source, BOS, EOS, k), prefix, steps, EOS, room)
    held: list[int] = list(prefix)
    call: StepCall | None = copy_run.first(StepCall(max(len(prefix) - 1, 0), prefix[-1:], [], 1))
    while call is not None:
        assert call.committed_len + len(call.append_ids) + len(call.draft_ids) <= room
        result = verify(top1, held, call)
        held = [*held[: call.committed_len], *call.append_ids, *call.draft_ids]
        call = copy_run.next(call, result)
    return copy_run


def greedy(top1, prefix: list[int], steps: int, room: int) -> list[int]:
    """`steps` plain greedy steps after `prefix`, as `core.greedy.greedy_next` runs them."""
    out: list[int] = []
    while len(out) < steps:
        token = top1([*prefix, *out])
        out.append(token)
        if token == EOS or len(prefix) + len(out) > room:
            break
    return out


@settings(max_examples=200, deadline=None)
@given(
    source=st.lists(st.integers(3, 12), min_size=1, max_size=30),
    edits=st.dictionaries(st.integers(0, 29), st.integers(3, 14), max_size=4),
    length=st.integers(0, 35),
    steps=st.integers(2, 40),
    k=st.integers(1, 12),
    room=st.integers(1, 60),
    start=st.integers(0, 5),
)
def test_a_copy_run_gives_the_greedy_tokens(source, edits, length, steps, k, room, start):
    top1 = model_for(source, edits, length)
    prefix = greedy(top1, [], start, room)
    if EOS in prefix or len(prefix) > room:
        return
    copy_run = run(top1, source, prefix, steps, k, room)
    assert copy_run.tokens == greedy(top1, prefix, steps, room)
    assert sum(n for _, n in copy_run.positions) == len(copy_run.tokens)
    for drafted, accepted in copy_run.blocks:
        assert 0 <= accepted <= drafted <= k
    # Every forward keeps its accepted drafts and, but for a run cut short, the verifier's own token.
    kept = sum(a for _, a in copy_run.blocks)
    assert kept <= len(copy_run.tokens) <= kept + len(copy_run.blocks)


def test_a_source_the_model_copies_takes_one_forward_per_block():
    source = list(range(3, 23))
    top1 = model_for(source, {}, len(source))
    copy_run = run(top1, source, [], 100, 8, 100)
    assert copy_run.tokens == [*source, EOS]
    assert copy_run.blocks == [(8, 8), (8, 8), (3, 3)]  # the last draft ends with the EOS, kept as drafted


def test_an_edit_costs_one_forward_and_copying_goes_on_after_it():
    source = list(range(3, 23))
    top1 = model_for(source, {5: 40}, len(source))
    copy_run = run(top1, source, [], 100, 32, 100)
    assert copy_run.tokens == [*source[:5], 40, *source[6:], EOS]
    assert copy_run.blocks == [(21, 5), (15, 15)]


def test_a_run_stops_at_its_steps_and_at_the_sessions_room():
    source = list(range(3, 23))
    top1 = model_for(source, {}, len(source))
    assert run(top1, source, [], 6, 32, 100).tokens == source[:6]
    assert run(top1, source, [], 100, 32, 10).tokens == source[:11]  # 10 final, the last not appended


@pytest.mark.parametrize("k, steps, code, message", [
    (-1, 5, StatusCode.INVALID_ARGUMENT, "copy_draft must be >= 0"),
    (4, 1, StatusCode.INVALID_ARGUMENT, "needs greedy_steps > 1"),
    (4, 0, StatusCode.INVALID_ARGUMENT, "needs greedy_steps > 1"),
    (65, 5, StatusCode.OUT_OF_RANGE, "limit is 64"),
])
def test_bad_copy_drafts_are_refused(k, steps, code, message):
    with pytest.raises(SpecdecError) as err:
        check_copy_draft(k, steps, 64)
    assert err.value.code == code and message in str(err.value)


def test_no_copy_draft_is_fine_anywhere():
    check_copy_draft(0, 0, 64)
    check_copy_draft(64, 2, 64)
