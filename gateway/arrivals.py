"""When the gateway's server last received a call: what its drain waits on before closing the listener.

Why the drain needs it: when grpc's `server.stop()` begins, grpc core ends with CANCELLED (not
UNAVAILABLE, and without running any handler) every call that has reached the server but has no
handler yet: the calls queued in grpc because the event loop had not yet asked for them, and those
that land before the client has read the server's GOAWAY (grpc/grpc#41785). No handler code can
answer those, so the gateway closes its listener only once calls have stopped arriving (`[gateway]
drain_quiet_s`, bounded by the grace); until then every new call reaches its handler, which answers
UNAVAILABLE "the gateway is draining" (tests/faults/test_listener_close.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import grpc

# A poll of the quiet watch that comes this much later than the last one means the event loop was
# held up: calls may then be waiting in grpc that no handler has seen yet, so quiet starts again.
_STALL_S = 0.1


class CallArrivals(grpc.aio.ServerInterceptor):
    """Records when (time.monotonic) the server last handed a call to a handler, any method.

    First in the interceptor chain, so calls that a later interceptor refuses (a missing token)
    count too: they race a closing listener the same way."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def watch(self) -> QuietWatch:
        return QuietWatch(self)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        self.last = time.monotonic()
        return await continuation(details)


class QuietWatch:
    """How long the server has been quiet since the watch began: no call arrived and the event loop
    (which runs the handlers, and so `CallArrivals`) was never held up between two polls. Poll
    `quiet_for()` from the loop, more often than every `_STALL_S`."""

    def __init__(self, arrivals: CallArrivals) -> None:
        self._arrivals = arrivals
        self._since = self._polled = time.monotonic()

    def quiet_for(self) -> float:
        now = time.monotonic()
        if now - self._polled > _STALL_S:
            self._since = now
        self._polled = now
        return now - max(self._since, self._arrivals.last)
