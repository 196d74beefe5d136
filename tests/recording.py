"""What the tests of drafting ahead (overlapped drafting, pre-verify) share.

A real drafter seen through a recorder: which thread called which session method when, how many
calls were in flight at once, and whether a call came after `close`. Optional hooks run inside a
call, before the real one, on the calling thread: to slow a call down, to wait for a test's signal,
or to make it fail as a dead drafter does. A real verifier seen likewise (`StepsVerifier`: the draft
length of every step, and a failure where a test wants one). The checks both test files run: a
decode equal to the plain loop's, a drafter session left clean, a drafter death, a verifier failure.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import strategies as st

from core.interfaces import Draft
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.policies.loop import DecodeResult
from gateway.peers.remote import DrafterFailure
from tests.zoo import model_pool

PREDRAFT_THREAD = "specdec-predraft"  # decoding.policies.overlap's pool threads' name prefix


@functools.cache
def local_verifier(trio: int):
    """The in-process verifier of the tiny float64 trio `trio` (tests.zoo), one per trio."""
    from verifier_service.session import LocalVerifier

    return LocalVerifier(model_pool()[trio].verifier)


@functools.cache
def local_drafter(trio: int):
    """The in-process drafters of the tiny float64 trio `trio`, one per trio."""
    from drafter_service.session import LocalDrafter

    return LocalDrafter(model_pool()[trio].drafter_models())


@dataclass
class Call:
    method: str
    thread: str
    committed_len: int
    append_ids: list[int]
    size: int

    @property
    def predraft(self) -> bool:
        return self.thread.startswith(PREDRAFT_THREAD)


@dataclass
class Record:
    """Everything one request did to its drafter session."""

    calls: list[Call] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    closed: bool = False
    in_flight_at_close: int = 0
    calls_after_close: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_predraft_thread(self) -> list[Call]:
        return [c for c in self.calls if c.predraft]

    def on_decode_thread(self) -> list[Call]:
        return [c for c in self.calls if not c.predraft]

    def assert_clean(self) -> None:
        assert self.most_in_flight <= 1  # never a second call while one is in flight
        assert self.closed and self.in_flight_at_close == 0 and self.calls_after_close == 0


# hook(call, record): runs inside the call before the real one; may sleep, wait or raise.
Hook = Callable[[Call, Record], None]


class RecordingDrafter:
    """A `core.interfaces.Drafter` over a real one; `records` holds one Record per opened session."""

    def __init__(self, inner, hook: Hook | None = None) -> None:
        self.inner = inner
        self.hook = hook
        self.vocab_size = inner.vocab_size
        self.records: list[Record] = []

    def open(self, source_ids: list[int], seed: int = 0) -> RecordingSession:
        record = Record()
        self.records.append(record)
        return RecordingSession(self.inner.open(source_ids, seed=seed), record, self.hook)


class RecordingSession:
    def __init__(self, inner, record: Record, hook: Hook | None) -> None:
        self.inner = inner
        self.record = record
        self.hook = hook

    def draft_block(self, committed_len: int, append_ids: list[int], k: int) -> Draft:
        return self._call("block", committed_len, append_ids, k, lambda: self.inner.draft_block(committed_len,
                                                                                                 append_ids, k))

    def draft_beam(self, committed_len: int, append_ids: list[int], gamma: int, num_beams: int) -> Draft:
        return self._call("beam", committed_len, append_ids, gamma,
                          lambda: self.inner.draft_beam(committed_len, append_ids, gamma, num_beams))

    def draft_sample(self, committed_len, append_ids, gamma, params) -> Draft:
        return self._call("sample", committed_len, append_ids, gamma,
                          lambda: self.inner.draft_sample(committed_len, append_ids, gamma, params))

    def close(self) -> None:
        with self.record.lock:
            self.record.closed = True
            self.record.in_flight_at_close = self.record.in_flight
        self.inner.close()

    def _call(self, method: str, committed_len: int, append_ids: list[int], size: int, run) -> Draft:
        call = Call(method, threading.current_thread().name, committed_len, list(append_ids), size)
        r = self.record
        with r.lock:
            r.calls.append(call)
            r.calls_after_close += r.closed
            r.in_flight += 1
            r.most_in_flight = max(r.most_in_flight, r.in_flight)
        try:
            if self.hook is not None:
                self.hook(call, r)
            return run()
        finally:
            with r.lock:
                r.in_flight -= 1


def dies_at_pool_call(n: int) -> Hook:
    """The drafter dies during its `n`-th call on a pool thread; every call after it fails too."""
    dead = threading.Event()

    def hook(call: Call, record: Record) -> None:
        if call.predraft and len(record.on_predraft_thread()) == n:
            time.sleep(0.02)
            dead.set()
        if dead.is_set():
            raise DrafterFailure(ConnectionError("drafter process died"))

    return hook


def assert_a_drafter_death_fails_over_to_ar(source: list[int], config: DecodingConfig, verifier, drafter) -> None:
    """Decode with a drafter that dies during its third call on the pool: the decode fails as the
    plain loop's draft would (`DrafterFailure`), what it committed is greedy's beginning, and the
    gateway's fallback (plain AR from there) gives the greedy output; the drafter session was left clean."""
    recording = RecordingDrafter(drafter, hook=dies_at_pool_call(3))
    committed: list[int] = []
    with pytest.raises(DrafterFailure, match="drafter process died"):
        decode(source, config, verifier, recording, on_tokens=committed.extend)
    ar = DecodingConfig(mode=Mode.AR, max_new_tokens=config.max_new_tokens)
    greedy = decode(source, ar, verifier, None).output_ids
    assert committed and committed == greedy[: len(committed)]
    assert decode(source, ar, verifier, None, prefix=committed).output_ids == greedy
    (record,) = recording.records
    record.assert_clean()


class StepsVerifier:
    """The real verifier, keeping the draft length of every step of its sessions (`lengths`) and,
    of every step answered, its draft and the verifier's top-1 tokens (`steps`). With `fails`, a
    step fails (a verifier outage mid-request) when `fails(lengths)` says so once its own length is
    in, after `before_failing()`."""

    def __init__(
        self, inner, fails: Callable[[list[int]], bool] | None = None, before_failing: Callable[[], None] = lambda: None
    ) -> None:
        self.inner = inner
        self.fails = fails
        self.before_failing = before_failing
        self.lengths: list[int] = []
        self.steps: list[tuple[list[int], list[int]]] = []
        for name in ("vocab_size", "source_vocab_size", "bos_id", "eos_id", "max_source_len", "max_target_len"):
            setattr(self, name, getattr(inner, name))

    def open(self, source_ids: list[int]):
        session = self.inner.open(source_ids)
        outer = self

        class Stepping:
            def step(self, committed_len, append_ids, draft_ids, top_k):
                outer.lengths.append(len(draft_ids))
                if outer.fails is not None and outer.fails(outer.lengths):
                    outer.before_failing()
                    raise RuntimeError("verifier went away")
                result = session.step(committed_len, append_ids, draft_ids, top_k)
                outer.steps.append((list(draft_ids), list(result.top1)))
                return result

            def close(self) -> None:
                session.close()

        return Stepping()


def assert_a_verifier_failure_waits_for_the_pool_call(
    source: list[int], config: DecodingConfig, verifier, drafter, fails: Callable[[list[int]], bool]
) -> None:
    """Decode with slow drafter calls on the pool and a verifier that fails at the step `fails`
    picks, once a drafter call is under way: the failure reaches the caller, and no drafter call was
    left in flight at the session's close."""

    def slow(call: Call, record: Record) -> None:
        if call.predraft:
            time.sleep(0.05)

    recording = RecordingDrafter(drafter, hook=slow)

    def pool_call_running() -> bool:  # the pool may start it late on a busy machine: wait, bounded
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with recording.records[0].lock:
                if recording.records[0].in_flight:
                    return True
            time.sleep(0.001)
        return False

    running: list[bool] = []
    failing = StepsVerifier(verifier, fails, before_failing=lambda: running.append(pool_call_running()))
    with pytest.raises(RuntimeError, match="verifier went away"):
        decode(source, config, failing, recording)
    (record,) = recording.records
    assert running == [True], "a drafter call was under way on the pool when the verifier failed"
    assert record.on_predraft_thread()
    record.assert_clean()


def block_mode_configs() -> st.SearchStrategy[dict]:
    """Decoding parameters of the block-drafting modes, GAD and GAD++ (both overlap and pre-verify)."""
    gad = st.fixed_dictionaries({"mode": st.just(Mode.GAD), "k": st.integers(1, 16)})
    gad_pp = st.fixed_dictionaries({
        "mode": st.just(Mode.GAD_PLUS_PLUS), "k": st.integers(1, 16), "beta": st.integers(1, 5),
        "tau": st.sampled_from([0.0, 0.5, 1.0, 3.0, 100.0]),
    })
    return st.one_of(gad, gad_pp)


def assert_same_decode(plain: DecodeResult, other: DecodeResult) -> None:
    """`other` decoded as `plain` (nothing drafted ahead) did: the same output, step for step."""
    assert other.output_ids == plain.output_ids
    a, b = plain.stats, other.stats
    assert (b.iterations, b.drafted_tokens, b.accepted_tokens, b.finish_reason) == (
        a.iterations, a.drafted_tokens, a.accepted_tokens, a.finish_reason
    )
    assert b.accepted_per_position == a.accepted_per_position
    assert b.steps_per_draft_length == a.steps_per_draft_length
    assert a.predrafts == a.predrafts_used == a.preverified == a.preverify_cuts == 0  # plain: nothing ahead
