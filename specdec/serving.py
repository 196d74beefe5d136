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

from specdec.errors import SpecdecError, StatusCode
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

    async def set_serving(self) -> None:
        for service in ["", *self.service_names]:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.log.info("serving")

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
