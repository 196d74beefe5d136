"""The "one stream = one session" protocol the Verify and Draft RPCs share. Model work runs on the
service's `StepExecutor` (serving/batching.py: one worker thread and its batching scheduler)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from core.errors import SpecdecError, StatusCode, invalid
from serving.batching import StepExecutor
from serving.host import ServiceHost
from serving.metrics import Registry
from serving.status import abort_with, request_id_of

__all__ = ["SessionStreams", "StepExecutor"]


class SessionStreams:
    """The "one stream = one session" protocol the Verify and Draft RPCs share: admission control,
    an `open` message then `step` messages, errors as status codes, and the session freed the
    moment the stream ends for any reason (half-close, cancel, deadline, dead client, idle).

    Admission is atomic: a stream takes its slot (`admitted`) before its first await and gives it
    back in `finally`, so racing opens can never pass `max_sessions` (the event loop runs one
    coroutine at a time; a check before an await and a count after it let every racer through).
    A stream that sends no message for `idle_s` seconds is ended with DEADLINE_EXCEEDED, so idle
    clients cannot hold every slot for ever.
    """

    def __init__(
        self,
        host: ServiceHost,
        executor: StepExecutor,
        registry: Registry,
        rpc: str,
        max_sessions: int,
        idle_s: float = 0.0,
    ) -> None:
        self.host = host
        self.executor = executor
        # Closes a session on the worker that owns it (a service with several model workers says which).
        self.close_soon: Callable[[Any], None] = lambda session: executor.submit(session.close)
        self.rpc = rpc
        self.max_sessions = max_sessions
        self.idle_s = idle_s  # 0: no idle timeout
        self.sessions: set = set()
        self.admitted = 0  # slots taken: streams admitted and not yet ended (opened or opening)
        self.peak = 0  # the most slots ever taken at once
        prefix = host.name
        self.m_sessions = registry.counter(f"{prefix}_sessions", f"{rpc} streams opened (requests)")
        self.m_errors = registry.counter(f"{prefix}_errors", "streams ended with an error, by status code")
        self.m_rejected = registry.counter(f"{prefix}_rejected", "streams refused for capacity")
        self.m_active = registry.gauge(f"{prefix}_active_sessions", f"open {rpc} sessions")
        self.m_peak = registry.gauge(f"{prefix}_peak_sessions", f"the most {rpc} streams admitted at once")
        self.m_idle = registry.counter(f"{prefix}_idle_closed", f"{rpc} streams ended for sending nothing for idle_s")

    def _admit(self) -> bool:
        """Take a slot, or False when all are taken. No await here: the check and the count are one step."""
        if self.admitted >= self.max_sessions:
            return False
        self.admitted += 1
        if self.admitted > self.peak:
            self.peak = self.admitted
            self.m_peak.set(self.peak)
        return True

    async def _next(self, messages):
        """The client's next message, None at its half-close; DEADLINE_EXCEEDED after idle_s of silence."""
        try:
            if not self.idle_s:
                return await anext(messages)
            # asyncio.timeout, not wait_for: wait_for wraps every message in a new task (a measurable
            # share of a loaded verifier's event loop); the timeout only reschedules a timer.
            async with asyncio.timeout(self.idle_s):
                return await anext(messages)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            self.m_idle.inc()
            raise SpecdecError(
                StatusCode.DEADLINE_EXCEEDED,
                f"no message for {self.idle_s:g} s: the idle {self.host.name} session is closed",
            ) from None

    async def serve(self, request_iterator, context, open_session, step):
        """Async generator of responses. `open_session(open_msg)` returns (session, response);
        `step(session, step_msg)` returns a response. Both raise SpecdecError for the client."""
        log = self.host.log.bind(request_id=request_id_of(context))
        if self.host.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.host.name} is draining")
        if not self._admit():
            self.m_rejected.inc(reason="sessions")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_sessions} sessions are open; try again later"
            )
        session = None
        self.m_sessions.inc()
        try:
            messages = aiter(request_iterator)
            while (request := await self._next(messages)) is not None:
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
            self.admitted -= 1
            log.info("session_closed", opened=session is not None)
            if session is not None:
                self.sessions.discard(session)
                self.m_active.set(len(self.sessions))
                # Close on the worker so a step still running for a cancelled stream finishes first.
                self.close_soon(session)
