"""What a gateway's call to a peer carries and how it fails: the request's call options (deadline,
request id, cancel switch) and the errors a peer call raises, for both stream paths
(`gateway.peers.remote`'s synchronous streams and `gateway.peers.streams`' grpc.aio ones).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from core.errors import SpecdecError, StatusCode
from serving.status import REQUEST_ID_KEY, specdec_code


class RemoteCallError(Exception):
    """A peer failed with a status that is not the client's fault (INTERNAL, UNKNOWN, ...)."""

    def __init__(self, peer: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{peer}: {code.name}: {details}")
        self.peer = peer
        self.code = code
        self.details = details


class DrafterFailure(Exception):
    """The drafter is unreachable, failed or timed out; the gateway may fall back to AR."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(f"drafter failed: {cause}")
        self.cause = cause


class RequestCancelled(Exception):
    """The request was cancelled (the client went away): stop; no peer is at fault."""


class RequestDeadlineExceeded(SpecdecError):
    """The request's own deadline passed during a peer call: the client's budget, not a peer failure.

    A drafter call that times out on the drafter's own, shorter cap is a `DrafterFailure` instead;
    only the request's deadline is reported as this, so one client's short deadlines cannot open
    the drafter retry window for everybody."""

    def __init__(self, peer: str, details: str) -> None:
        super().__init__(StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded while waiting for the {peer}: {details}")


class Cancellation:
    """One request's cancel switch, shared by the event loop and the worker thread decoding it.

    `cancel()` sets the flag and cancels every peer call in flight, so a worker blocked in a verifier
    or drafter step returns at once (with `RequestCancelled`) instead of when the step ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._calls: set = set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        with self._lock:
            self._event.set()
            calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cancel()

    def check(self) -> None:
        if self._event.is_set():
            raise RequestCancelled()

    def track(self, call) -> None:
        with self._lock:
            if not self._event.is_set():
                self._calls.add(call)
                return
        call.cancel()
        raise RequestCancelled()

    def untrack(self, call) -> None:
        with self._lock:
            self._calls.discard(call)


@dataclass(frozen=True)
class CallOptions:
    """Per-request call settings: an absolute deadline (time.monotonic), the request id, the
    request's cancel switch (None: calls are not cancellable from outside), and whether its client
    reads tokens as they come (GenerateStream: the verifier's first greedy runs are short)."""

    deadline: float | None = None
    request_id: str = ""
    cancellation: Cancellation | None = field(default=None, compare=False)
    streaming: bool = False

    def timeout(self, cap: float | None = None) -> float | None:
        left = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.001)
        if cap is None:
            return left
        return cap if left is None else min(left, cap)

    def capped(self, cap: float | None) -> bool:
        """Whether `timeout(cap)` is the cap rather than the request's own deadline."""
        if cap is None:
            return False
        return self.deadline is None or cap < self.deadline - time.monotonic()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((REQUEST_ID_KEY, self.request_id),) if self.request_id else ()


def peer_error(peer: str, exc: grpc.RpcError) -> Exception:
    """A peer's failure status as the gateway raises it: a `SpecdecError` where the code is one of
    ours (UNAVAILABLE named as the peer being down), else a `RemoteCallError`."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or str(exc)
    mapped = specdec_code(code)
    if mapped is not None:
        prefix = f"{peer} unavailable: " if mapped == StatusCode.UNAVAILABLE else ""
        return SpecdecError(mapped, prefix + details)
    return RemoteCallError(peer, code, details)
