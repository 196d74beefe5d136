"""The gateway's peer streams on grpc.aio, driven from decode threads.

`decode()` is synchronous and runs on a gateway worker thread; the peers' session streams live on
the gateway's own event loop as grpc.aio calls. A step is one coroutine (write the request, read the
answer) handed to the loop with `asyncio.run_coroutine_threadsafe`; the worker blocks on its future.
No thread is started per stream (the synchronous streams of `gateway.peers.remote._Stream` start a
request-iterator consumer thread for each), and a cancelled request's wait fails at once.

A step's latency matches the synchronous streams' at one request, since the round trip is
dominated by gRPC's own floor and the service's side (worker hop and Python around the forward),
not by the client's thread hops; under load no thread per stream pays (BENCHMARKS.md, "Peer
streams (aio and sync)", "Round trip split (CPU)"). The synchronous streams remain for callers
without an event loop, which pass a plain `grpc.Channel` (`gateway.peers.remote`).

Everything that touches a call runs on the loop (grpc.aio objects are not thread-safe); the worker
thread only schedules coroutines and waits. Cancelling the request (`Cancellation.cancel()`, from
any thread) fails the worker's wait at once and cancels the call on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from core.errors import SpecdecError, StatusCode
from gateway.peers.calls import CallOptions, RequestCancelled, RequestDeadlineExceeded, peer_error
from protos.specdec.v1 import drafter_pb2_grpc, verifier_pb2_grpc
from serving.tls import ClientTLS


class PeerChannel:
    """A grpc.aio channel to one peer (verifier or drafter), made on and bound to the gateway's loop.

    Create it on the loop (inside a coroutine); its streams may then be driven from any other thread."""

    def __init__(self, address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]]) -> None:
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.channel = (
            grpc.aio.insecure_channel(address, options=list(options)) if tls is None
            else grpc.aio.secure_channel(address, tls.credentials(), options=list(options))
        )
        self.verify = verifier_pb2_grpc.VerifierServiceStub(self.channel).Verify
        self.draft = drafter_pb2_grpc.DrafterServiceStub(self.channel).Draft

    def on_loop(self) -> bool:
        return threading.get_ident() == self._loop_thread

    async def close(self) -> None:
        await self.channel.close()


class AioStream:
    """One bidi session stream on a `PeerChannel`, driven step by step from a worker thread: the same
    surface as `gateway.peers.remote._Stream` (`exchange`, `close`, `cancel`), with the same errors.

    The `open` message goes out at once and its `opened` answer is read on the loop without anyone
    waiting for it, so the verifier's and the drafter's encoders run concurrently. The first step
    goes out right behind the `open`, before its answer (the peer reads its stream in order), so its
    round trip overlaps the peer's encoder run; the first `exchange` then reads the `opened` answer
    (raising what opening raised) and the step's."""

    def __init__(
        self, peer: str, channel: PeerChannel, method, options: CallOptions, cap: float | None, first
    ) -> None:
        if channel.on_loop():  # the worker would wait on the loop it blocks: a deadlock, never silently
            raise RuntimeError("peer streams are driven from worker threads, not from the event loop")
        self.peer = peer
        self._loop = channel.loop
        self._cancellation = options.cancellation
        if self._cancellation is not None:
            self._cancellation.check()  # cancelled before this session was opened: open nothing
        # A DEADLINE_EXCEEDED on a stream that runs to the request's deadline is the request's own.
        self._own_deadline = not options.capped(cap)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._open_sent: asyncio.Task | None = None  # writing the `open` message
        self._opening: asyncio.Task | None = None  # reading its `opened` answer
        self._pending: concurrent.futures.Future | None = None
        self._closed = False
        self._cancelled = False
        self._loop.call_soon_threadsafe(self._start, method, options.timeout(cap), options.metadata(), first)
        if self._cancellation is not None:
            try:
                self._cancellation.track(self)
            except RequestCancelled:
                self._closed = True
                raise

    def exchange(self, request):
        """Send one step and return its answer (blocking the calling worker thread)."""
        future = asyncio.run_coroutine_threadsafe(self._exchange(request), self._loop)
        self._pending = future
        if self._cancelled:  # cancelled between the check above and now: the cancel missed this future
            future.cancel()
        try:
            return future.result()
        except (concurrent.futures.CancelledError, asyncio.CancelledError):
            raise self._cancelled_error() from None
        except grpc.RpcError as exc:
            raise self._rpc_error(exc) from None
        finally:
            self._pending = None

    def cancel(self) -> None:
        """From any thread (the request's `Cancellation`): a worker blocked in `exchange` returns now."""
        self._cancelled = True
        future = self._pending
        if future is not None:
            future.cancel()  # wakes the waiting worker at once; its task is cancelled on the loop
        self._schedule(self._stop)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._schedule(self._stop)  # cancelling the call ends the stream, which frees the peer's session
        if self._cancellation is not None:
            self._cancellation.untrack(self)

    # ---- on the loop ---------------------------------------------------------------------------

    def _start(self, method, timeout: float | None, metadata, first) -> None:
        if self._cancelled or self._closed:
            return
        self._call = method(timeout=timeout, metadata=metadata)
        self._open_sent = self._loop.create_task(self._call.write(first))
        self._opening = self._loop.create_task(self._open())
        # Nobody may await them (the session closed before its first step): take their outcomes.
        self._open_sent.add_done_callback(_consume)
        self._opening.add_done_callback(_consume)

    async def _open(self):
        assert self._open_sent is not None
        await self._open_sent
        return await self._read()

    async def _exchange(self, request):
        opening, self._opening = self._opening, None
        call = self._call
        if call is None:  # closed or cancelled before the call was made
            raise asyncio.CancelledError()
        if opening is not None:  # the first step: written behind the `open`, then both answers read
            assert self._open_sent is not None
            await asyncio.wait([self._open_sent])  # messages go out in order; its failure is opening's
            if not (self._open_sent.cancelled() or self._open_sent.exception()):
                with contextlib.suppress(asyncio.InvalidStateError):  # the call ended: opening says why
                    await call.write(request)
            await opening
            return await self._read()
        with contextlib.suppress(asyncio.InvalidStateError):  # the call already ended: its status says why
            await call.write(request)
        return await self._read()

    async def _read(self):
        assert self._call is not None
        response = await self._call.read()
        if response is grpc.aio.EOF:
            raise SpecdecError(StatusCode.UNAVAILABLE, f"the {self.peer} ended the stream early")
        return response

    def _stop(self) -> None:
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        if self._call is not None:
            self._call.cancel()

    def _schedule(self, fn) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the call went with it
            self._loop.call_soon_threadsafe(fn)

    # ---- errors, as gateway.peers.remote._Stream raises them ------------------------------------------

    def _cancelled_error(self) -> Exception:
        if self._cancelled or (self._cancellation is not None and self._cancellation.cancelled):
            return RequestCancelled()
        return SpecdecError(StatusCode.UNAVAILABLE, f"the call to the {self.peer} was cancelled (the gateway stopping)")

    def _rpc_error(self, exc: grpc.RpcError) -> Exception:
        if self._cancelled or (self._cancellation is not None and self._cancellation.cancelled):
            return RequestCancelled()
        if self._own_deadline and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RequestDeadlineExceeded(self.peer, exc.details() or "")
        return peer_error(self.peer, exc)


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
