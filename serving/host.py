"""One grpc.aio server as every specdec service runs it: health, reflection, size limits, a metrics
endpoint and graceful draining (ARCHITECTURE.md, "Wire contracts", "Observability")."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable, Sequence

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from core.errors import BindError
from serving.channels import DEFAULT_MAX_MESSAGE_BYTES, server_options
from serving.malformed import MalformedRequests
from serving.metrics import MetricsServer, Registry
from serving.tls import ServerTLS, is_loopback


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
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self.name = name
        self.service_names = list(service_names)
        self.registry = registry
        # Bytes that do not parse are INVALID_ARGUMENT with a log line, not gRPC's silent UNKNOWN; the
        # caller's interceptors (the gateway's token check) run first, before anything is parsed.
        # No SO_REUSEPORT: with it grpc would share a taken port with another server (another stack's
        # calls would reach this one); without it a taken address is a start-up error.
        self.server = grpc.aio.server(
            options=[*server_options(max_message_bytes), ("grpc.so_reuseport", 0)],
            interceptors=[*interceptors, MalformedRequests(name)],
        )
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

    async def start(self, address: str, metrics_address: str | None = None, tls: ServerTLS | None = None) -> int:
        """Listen on `address` (TLS when `tls` is given) and serve metrics on `metrics_address`.

        Plaintext gRPC or a metrics endpoint reachable from other machines is allowed (a private
        network may be trusted) but logged as a warning, so it is never an accident nobody sees.
        """
        for service in ["", *self.service_names]:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            if tls is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, tls.credentials())
        except RuntimeError:  # grpc's "Failed to bind to address": taken, or not an address of this host
            self.port = 0
        if self.port == 0:
            raise BindError(f"{self.name}: cannot listen on {address}: {_why_not(address)}")
        if tls is None and not is_loopback(address.rpartition(":")[0]):
            self.log.warning("plaintext_beyond_loopback", address=address, hint="set tls_cert and tls_key")
        if metrics_address:  # bound before the server starts: a taken metrics port starts nothing
            host, port = metrics_host_port(metrics_address)
            if not is_loopback(host):
                self.log.warning("metrics_beyond_loopback", metrics_address=metrics_address)
            try:
                self._metrics = MetricsServer(self.registry, host.strip("[]"), port)
            except OSError as exc:
                raise BindError(f"{self.name}: cannot serve metrics on {metrics_address}: {exc.strerror}") from None
            self.metrics_port = self._metrics.port
        await self.server.start()
        if self._metrics is not None:
            self._metrics.start()
        self.log.info(
            "listening",
            address=address,
            port=self.port,
            metrics=self.metrics_url() or "off",
            metrics_port=self.metrics_port,
            tls=tls is not None,
            mtls=tls is not None and tls.client_ca is not None,
        )
        return self.port

    def metrics_url(self) -> str | None:
        """Where the Prometheus endpoint serves, or None when it is off."""
        if self._metrics is None:
            return None
        return f"http://{self._metrics.host}:{self.metrics_port}/metrics"

    async def set_serving(self, **details: object) -> None:
        """Report SERVING; `details` (model, backend) go into the log line, so a log says what runs."""
        for service in ["", *self.service_names]:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.log.info("serving", metrics=self.metrics_url() or "off", **details)

    async def drain(self, grace: float = 10.0) -> None:
        """Refuse new calls and let in-flight ones finish within `grace` seconds, then stop."""
        if self.draining:
            return
        await self.begin_drain(grace)
        await self.finish_drain(grace)

    async def begin_drain(self, grace: float) -> None:
        """Health NOT_SERVING and `draining` set, the listener still open: the owner's handlers answer
        new calls UNAVAILABLE with a reason while its in-flight calls finish (see GatewayServer.stop)."""
        self.draining = True
        self.log.info("draining", grace_s=grace)
        for service in ["", *self.service_names]:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def finish_drain(self, grace: float) -> None:
        """Close the listener; calls still running after `grace` seconds are cancelled by grpc."""
        self.log.info("closing_listener", grace_s=grace)
        await self.server.stop(grace)
        if self._metrics is not None:
            self._metrics.stop()
        self.log.info("stopped")

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def metrics_host_port(address: str) -> tuple[str, int]:
    """A metrics_address as (host, port); a bare ":port" stays on loopback. ValueError when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"metrics address {address!r}: expected HOST:PORT")
    return host or "127.0.0.1", int(port)


def check_can_listen(what: str, address: str) -> None:
    """Fail fast, before any model loads, when `address` (HOST:PORT) is already taken: a BindError
    naming it. Port 0 and Unix sockets always pass; the server's own bind is still checked."""
    if address.startswith("unix:"):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) == 0:
        return
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR as the servers set it: a port in TIME_WAIT is free, one with a listener is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise BindError(f"{what}: cannot listen on {address}: the address is already in use") from None
            # Not resolvable here (e.g. a name): the server's own bind reports it.


def _why_not(address: str) -> str:
    """The likely reason grpc could not bind `address` (grpc itself says only "Failed to bind")."""
    try:
        check_can_listen("", address)
    except BindError:
        return "the address is already in use"
    return "not an address of this host, or already in use"
