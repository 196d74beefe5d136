"""A real drafter seen through a recorder: which thread called which session method when, how many
calls were in flight at once, and whether a call came after `close` (overlapped-drafting tests).
Optional hooks run inside a call, before the real one, on the calling thread: to slow a call down,
to wait for a test's signal, or to make it fail as a dead drafter does."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from core.interfaces import Draft

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
