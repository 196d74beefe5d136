"""The gateway's admission decisions (gateway/admission.py), as the pure functions they are."""

from __future__ import annotations

import pytest

from core.errors import SpecdecError, StatusCode
from decoding.config import DecodingConfig, Mode
from gateway.admission import AdmissionQueue, Budget, Need, sessions_needed


def _queue(workers=8, verifier=8, drafter=8, max_queued=2, max_per_client=4) -> AdmissionQueue:
    return AdmissionQueue(lambda: Budget(workers, verifier, drafter), max_queued, max_per_client)


def _refusal(queue: AdmissionQueue, client: str, need: Need) -> str:
    with pytest.raises(SpecdecError) as info:
        queue.enter(client, need)
    assert info.value.code == StatusCode.RESOURCE_EXHAUSTED
    return info.value.message


@pytest.mark.parametrize(
    ("mode", "beams", "with_drafter", "need"),
    [
        (Mode.AR, 4, True, Need(1, 0)),
        (Mode.BEAM, 4, True, Need(1, 0)),  # every hypothesis is a row of one multi-row session
        (Mode.BEAM, 16, False, Need(1, 0)),
        (Mode.GAD, 4, True, Need(1, 1)),
        (Mode.GAD, 4, False, Need(1, 0)),
        (Mode.MJSD, 4, True, Need(1, 1)),  # the drafter's beams live in its one session
        (Mode.IAD, 4, True, Need(1, 0)),
    ],
)
def test_sessions_needed(mode, beams, with_drafter, need):
    assert sessions_needed(DecodingConfig(mode=mode, num_beams=beams), with_drafter) == need


def test_verifier_sessions_bound_what_runs_and_the_rest_waits_then_is_refused():
    q = _queue(verifier=8, max_queued=2)
    running = [q.enter("a", Need(4, 0)) for _ in range(2)]
    assert [t.admitted for t in running] == [True, True]
    waiting = [q.enter("a", Need(4, 0)) for _ in range(2)]
    assert [t.admitted for t in waiting] == [False, False]
    assert _refusal(q, "b", Need(1, 0)) == "gateway overloaded: 2 requests are queued; try again later"
    assert q.leave(running[0]) == [waiting[0]]  # 4 sessions back: exactly one beam-4 fits
    assert q.leave(waiting[1]) == []  # a waiter that gave up frees nothing
    assert sum(t.need.verifier for t in q.running) == 8


def test_workers_and_drafter_sessions_bound_what_runs():
    q = _queue(workers=2, verifier=0, drafter=1)  # verifier 0: not reported, unbounded
    first = q.enter("a", Need(1, 1))
    assert first.admitted
    assert not q.enter("b", Need(1, 1)).admitted  # the drafter's one session is taken
    assert q.enter("c", Need(1, 0)).admitted is False  # FIFO: no overtaking of the waiting one
    assert [t.client for t in q.leave(first)] == ["b", "c"]


def test_a_request_larger_than_the_budget_is_refused_at_once():
    q = _queue(verifier=8)
    expected = "gateway overloaded: the request needs 16 verifier sessions; the verifier has 8"
    assert _refusal(q, "a", Need(16, 0)) == expected


def test_per_client_cap_counts_running_and_queued():
    q = _queue(workers=1, max_queued=8, max_per_client=2)
    q.enter("flood", Need(1, 0))
    q.enter("flood", Need(1, 0))
    assert _refusal(q, "flood", Need(1, 0)) == "gateway overloaded: client flood already has 2 requests in the gateway"
    assert not q.enter("good", Need(1, 0)).admitted  # another client still gets a place


def test_the_client_with_fewest_running_goes_first():
    q = _queue(workers=2, max_queued=8, max_per_client=8)
    flood = [q.enter("flood", Need(1, 0)) for _ in range(5)]  # 2 run, 3 wait
    good = q.enter("good", Need(1, 0))  # arrives last
    assert q.leave(flood[0]) == [good]  # ... and is let in first: it has nothing running
    assert q.leave(flood[1]) == [flood[2]]  # then the flood again, in arrival order
