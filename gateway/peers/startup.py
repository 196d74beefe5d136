"""The gateway's peers as it sees them: waiting for them at start-up (logged, abandoned on SIGTERM),
and the drafter replicas (each checked against the verifier, the retry window after a failure).

The verifier is required: the gateway does not serve without it. The drafter is optional: while it
is down, requests of the drafter modes fall back to plain AR through the verifier (`fallback = "ar"`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import structlog

from core.errors import SpecdecError, StatusCode
from core.wire import SPECIAL_ID_FIELDS
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.peers.remote import CallOptions, RemoteDrafter
from gateway.peers.replicas import Replica, ReplicaSet
from gateway.peers.triton import TritonVerifierClient
from protos.specdec.v1 import common_pb2
from serving.tls import ClientTLS

# Waiting for a peer at start-up: how often the wait looks at SIGTERM, and how often it is logged.
WAIT_POLL_S = 0.5
WAIT_LOG_S = 5.0
SET_POLL_S = 0.05  # how often a wait for a replica set looks at it


class StartAbandoned(Exception):
    """Start-up was given up (SIGTERM) while the gateway waited for a peer."""


class StartupWait:
    """Waits for peers at start-up, up to `timeout` seconds each, logging which peer and address it
    waits for every WAIT_LOG_S seconds; StartAbandoned once `abandon` is set."""

    def __init__(self, timeout: float, log, abandon: threading.Event) -> None:
        self.timeout = timeout
        self.log = log
        self.abandon = abandon

    def replicas(self, replicas: ReplicaSet, peer: str) -> list[str]:
        """Until a replica of the set is usable (their addresses); grpc.FutureTimeoutError past the
        timeout; ValueError (the reasons) while every replica known has been refused."""
        poll = self.poller(peer, replicas.spec)
        polled = time.monotonic()
        while True:
            usable = replicas.usable()
            if usable:
                return usable
            refused = replicas.refusals()
            if refused:
                raise ValueError("; ".join(refused))
            time.sleep(SET_POLL_S)
            if time.monotonic() - polled >= WAIT_POLL_S:
                polled = time.monotonic()
                poll()

    def triton_info(self, triton: TritonVerifierClient, address: str) -> common_pb2.ModelInfo:
        """The Triton-hosted verifier's ModelInfo, once the server is up and the model loaded."""
        deadline = time.monotonic() + self.timeout
        poll = self.poller("verifier", address)
        while True:
            try:
                return triton.fetch_info(timeout=min(WAIT_POLL_S, max(deadline - time.monotonic(), 0.1)))
            except SpecdecError:
                if time.monotonic() >= deadline:
                    raise
                poll()
                time.sleep(0.2)

    def poller(self, peer: str, address: str | None) -> Callable[[], None]:
        """Called at each poll while waiting for `peer`: logs, or raises once abandoned or timed out."""
        started = time.monotonic()
        logged: float | None = None

        def poll() -> None:
            nonlocal logged
            if self.abandon.is_set():
                raise StartAbandoned(f"stopped while waiting for the {peer} at {address}")
            now = time.monotonic()
            if now - started >= self.timeout:
                raise grpc.FutureTimeoutError()
            if logged is None or now - logged >= WAIT_LOG_S:
                logged = now
                self.log.info("waiting_for_peer", peer=peer, address=address, waited_s=round(now - started, 1),
                              timeout_s=self.timeout)

        return poll


class DrafterPeer:
    """The drafter replicas (`gateway.peers.replicas`), each checked against the verifier's ModelInfo, and
    the retry window: after a failed attempt a replica is skipped for `drafter_retry_s`, then tried
    again."""

    def __init__(self, config: GatewayConfig, tls: ClientTLS | None, metrics: GatewayMetrics) -> None:
        assert config.drafter_address
        self.address = config.drafter_address
        self.config = config
        self.replicas = ReplicaSet("drafter", self.address, tls, self._check, metrics, config.resolve_interval_s)
        self.verifier: common_pb2.ModelInfo | None = None
        self.log = structlog.get_logger(service="gateway")

    @property
    def info(self) -> common_pb2.ModelInfo | None:
        """The first accepted drafter replica's ModelInfo (every other one serves the same bundle)."""
        return self.replicas.reference

    async def start(self, verifier: common_pb2.ModelInfo) -> None:
        """Start watching the replicas, each checked against `verifier` (on the event loop)."""
        self.verifier = verifier
        await self.replicas.start()

    def check_at_start(self, wait: StartupWait) -> None:
        """Wait for a drafter replica; none within the timeout is an error only with `fallback =
        "fail"` (else the gateway starts and uses replicas as they come). A replica that disagrees
        with the verifier, while no other is known, is a ValueError."""
        try:
            usable = wait.replicas(self.replicas, "drafter")
        except grpc.FutureTimeoutError:
            if self.config.fallback != "ar":
                raise SpecdecError(
                    StatusCode.UNAVAILABLE, f"drafter at {self.address}: no replica SERVING within {wait.timeout}s"
                ) from None
            self.log.warning("drafter_unreachable_at_start", address=self.address)
            return
        self.log.info("drafter_replicas", usable=usable, address=self.address)

    @contextlib.contextmanager
    def lease(self, options: CallOptions, exclude: set[str]) -> Iterator[tuple[RemoteDrafter, Replica] | None]:
        """A drafter on the replica with the most free sessions, or None while none is usable."""
        with self.replicas.lease(exclude) as replica:
            if replica is None or replica.info is None:
                yield None
                return
            yield RemoteDrafter(replica.channel, replica.info, options, self.config.drafter_timeout_s), replica

    def failed(self, replica: Replica, exc: Exception) -> None:
        """A real attempt at `replica` failed: skip it for drafter_retry_s, then try again."""
        self.replicas.failed(replica, self.config.drafter_retry_s, exc)

    async def close(self) -> None:
        await self.replicas.close()

    def _check(self, info: common_pb2.ModelInfo) -> str | None:
        assert self.verifier is not None
        mismatch = [
            name
            for name in ("vocab_size", "source_vocab_size", "tokenizer_fingerprint", *SPECIAL_ID_FIELDS)
            if getattr(info, name) != getattr(self.verifier, name)
        ]
        if mismatch:
            return f"drafter and verifier disagree on {', '.join(mismatch)}; refusing to combine them"
        return None
