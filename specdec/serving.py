"""What every specdec gRPC server shares: status mapping, request ids, logging, health,
reflection, message size limits, metrics endpoint and graceful draining (DESIGN sections 2, 5).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import uuid
from collections.abc import Iterable

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from specdec.errors import SpecdecError, StatusCode, invalid
from specdec.metrics import MetricsServer, Registry

# gRPC metadata key carrying the request id across gateway, drafter and verifier.
REQUEST_ID_KEY = "x-request-id"
# Sessions move a few hundred bytes per step; 16 MiB leaves room for full-vocabulary rows.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def grpc_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    # Short reconnect backoff: a restarted drafter should be used again within about a second,
    # not after gRPC's default of up to two minutes.
    return [
        *grpc_options(max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def grpc_code(code: StatusCode) -> grpc.StatusCode:
    return grpc.StatusCode[code.value]


def specdec_code(code: grpc.StatusCode) -> StatusCode | None:
    try:
        return StatusCode(code.name)
    except ValueError:
        return None


def request_id_of(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return str(value)
    return uuid.uuid4().hex


async def abort_with(context: grpc.aio.ServicerContext, exc: SpecdecError) -> None:
    await context.abort(grpc_code(exc.code), exc.message)


def configure_logging(level: int = logging.INFO) -> None:
    """structlog JSON lines on stderr; every line of a request carries its `request_id`."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


class ServiceHost:
    """One grpc.aio server with health, reflection, size limits and a metrics endpoint.

    Health starts NOT_SERVING; the owner calls `set_serving()` after warm-up. `drain()` turns
    health NOT_SERVING, refuses new calls and lets in-flight ones finish within `grace` seconds.
    """

    def __init__(
        self,
        name: str,
        service_names: Iterable[str],
        registry: Registry,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.name = name
        self.service_names = list(service_names)
        self.registry = registry
        self.server = grpc.aio.server(options=grpc_options(max_message_bytes))
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        self.draining = False
        self.port = 0
        self.metrics_port = 0
        self._metrics: MetricsServer | None = None
        self.log = structlog.get_logger(service=name)

    async def start(self, address: str, metrics_address: str | None = None) -> int:
        for service in ["", *self.service_names]:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"{self.name}: cannot bind {address}")
        await self.server.start()
        if metrics_address:
            host, _, port = metrics_address.rpartition(":")
            self._metrics = MetricsServer(self.registry, host or "127.0.0.1", int(port)).start()
            self.metrics_port = self._metrics.port
        self.log.info("listening", address=address, port=self.port, metrics_port=self.metrics_port)
        return self.port

    async def set_serving(self, **details: object) -> None:
        """Report SERVING; `details` (model, backend) go into the log line, so a log says what runs."""
        for service in ["", *self.service_names]:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.log.info("serving", **details)

    async def drain(self, grace: float = 10.0) -> None:
        if self.draining:
            return
        self.draining = True
        self.log.info("draining", grace_s=grace)
        for service in ["", *self.service_names]:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace)
        if self._metrics is not None:
            self._metrics.stop()
        self.log.info("stopped")

    async def wait(self) -> None:
        await self.server.wait_for_termination()


class StepExecutor:
    """Runs model work (torch ops) off the event loop, on one worker thread.

    One thread, because torch already uses every core inside one op and two sessions' forwards
    would only contend. In the verifier this is the seam for the batching scheduler (DESIGN
    section 4): a scheduler would replace `run` with a queue that gathers steps of many sessions
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
