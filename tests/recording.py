"""A real drafter seen through a recorder: which thread called which session method when, how many
calls were in flight at once, and whether a call came after `close` (overlapped-drafting and
pre-verify tests). Optional hooks run inside a call, before the real one, on the calling thread: to
slow a call down, to wait for a test's signal, or to make it fail as a dead drafter does; and the
check both test files run when the drafter dies during a call on the pool."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from core.interfaces import Draft
from gateway.decode import decode
from gateway.decoding_config import DecodingConfig, Mode
from gateway.remote import DrafterFailure

PREDRAFT_THREAD = "specdec-predraft"  # gateway.policies.overlap's pool threads' name prefix


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


def assert_a_drafter_death_fails_over_to_ar(source: list[int], config: DecodingConfig, verifier, drafter) -> Record:
    """Decode with a drafter that dies during its third call on the pool: the decode fails as the
    plain loop's draft would (`DrafterFailure`), what it committed is greedy's beginning, and the
    gateway's fallback (plain AR from there) gives the greedy output. Returns the drafter's record."""
    recording = RecordingDrafter(drafter, hook=dies_at_pool_call(3))
    committed: list[int] = []
    with pytest.raises(DrafterFailure, match="drafter process died"):
        decode(source, config, verifier, recording, on_tokens=committed.extend)
    ar = DecodingConfig(mode=Mode.AR, max_new_tokens=config.max_new_tokens)
    greedy = decode(source, ar, verifier, None).output_ids
    assert committed and committed == greedy[: len(committed)]
    assert decode(source, ar, verifier, None, prefix=committed).output_ids == greedy
    (record,) = recording.records
    return record


class FailingVerifier:
    """The real verifier, whose session fails at the first step that `fails(draft lengths of the
    steps so far, this one's last)` picks (a verifier outage mid-request), after `before_failing()`."""

    def __init__(self, inner, fails: Callable[[list[int]], bool], before_failing: Callable[[], None]) -> None:
        self.inner = inner
        self.fails = fails
        self.before_failing = before_failing
        for name in ("vocab_size", "bos_id", "eos_id", "max_source_len", "max_target_len"):
            setattr(self, name, getattr(inner, name))

    def open(self, source_ids: list[int]):
        session = self.inner.open(source_ids)
        lengths: list[int] = []
        outer = self

        class Failing:
            def step(self, committed_len, append_ids, draft_ids, top_k):
                lengths.append(len(draft_ids))
                if outer.fails(lengths):
                    outer.before_failing()
                    raise RuntimeError("verifier went away")
                return session.step(committed_len, append_ids, draft_ids, top_k)

            def close(self) -> None:
                session.close()

        return Failing()


def assert_a_verifier_failure_waits_for_the_pool_call(
    source: list[int], config: DecodingConfig, verifier, drafter, fails: Callable[[list[int]], bool]
) -> Record:
    """Decode with slow drafter calls on the pool and a verifier that fails at the step `fails`
    picks, once a drafter call is under way: the failure reaches the caller, and (the caller checks
    on the returned record) no drafter call was left in flight at the session's close."""

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
    failing = FailingVerifier(verifier, fails, before_failing=lambda: running.append(pool_call_running()))
    with pytest.raises(RuntimeError, match="verifier went away"):
        decode(source, config, failing, recording)
    (record,) = recording.records
    assert running == [True], "a drafter call was under way on the pool when the verifier failed"
    assert record.on_predraft_thread()
    return record
