"""The "one stream = one session" protocol the Verify and Draft RPCs share, and the worker thread
model work runs on."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from core.errors import SpecdecError, invalid
from serving.host import ServiceHost
from serving.metrics import Registry
from serving.status import abort_with, request_id_of


class StepExecutor:
    """Runs model work (torch ops) off the event loop, on one worker thread.

    One thread, because torch already uses every core inside one op and two sessions' forwards
    would only contend. In the verifier this is the seam for the batching scheduler
    (ARCHITECTURE.md section 8): a scheduler would replace `run` with a queue that gathers steps of many sessions
    into one ragged forward; the servicer's code would not change.
    """

    def __init__(self, name: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-model")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn, *args) -> None:
        with contextlib.suppress(RuntimeError):  # shut down: nothing left to free
            self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class SessionStreams:
    """The "one stream = one session" protocol the Verify and Draft RPCs share: admission control,
    an `open` message then `step` messages, errors as status codes, and the session freed the
    moment the stream ends for any reason (half-close, cancel, deadline, dead client)."""

    def __init__(
        self, host: ServiceHost, executor: StepExecutor, registry: Registry, rpc: str, max_sessions: int
    ) -> None:
        self.host = host
        self.executor = executor
        self.rpc = rpc
        self.max_sessions = max_sessions
        self.sessions: set = set()
        prefix = host.name
        self.m_sessions = registry.counter(f"{prefix}_sessions", f"{rpc} streams opened (requests)")
        self.m_errors = registry.counter(f"{prefix}_errors", "streams ended with an error, by status code")
        self.m_rejected = registry.counter(f"{prefix}_rejected", "streams refused for capacity")
        self.m_active = registry.gauge(f"{prefix}_active_sessions", f"open {rpc} sessions")

    async def serve(self, request_iterator, context, open_session, step):
        """Async generator of responses. `open_session(open_msg)` returns (session, response);
        `step(session, step_msg)` returns a response. Both raise SpecdecError for the client."""
        log = self.host.log.bind(request_id=request_id_of(context))
        if self.host.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.host.name} is draining")
        if len(self.sessions) >= self.max_sessions:
            self.m_rejected.inc(reason="sessions")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_sessions} sessions are open; try again later"
            )
        session = None
        self.m_sessions.inc()
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("kind")
                if session is None:
                    if kind != "open":
                        raise invalid(f"the first message of a {self.rpc} stream must be `open`")
                    session, response = await open_session(request.open)
                    self.sessions.add(session)
                    self.m_active.set(len(self.sessions))
                    log.info("session_opened", source_len=len(request.open.source_ids), active=len(self.sessions))
                    yield response
                    continue
                if kind != "step":
                    raise invalid(f"only the first message of a {self.rpc} stream may be `open`")
                yield await step(session, request.step)
        except SpecdecError as exc:
            self.m_errors.inc(code=exc.code.value)
            log.info(f"{self.rpc.lower()}_refused", code=exc.code.value, message=exc.message)
            await abort_with(context, exc)
        finally:
            log.info("session_closed", opened=session is not None)
            if session is not None:
                self.sessions.discard(session)
                self.m_active.set(len(self.sessions))
                # Close on the worker so a step still running for a cancelled stream finishes first.
                self.executor.submit(session.close)
