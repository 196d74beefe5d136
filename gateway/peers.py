"""The gateway's peers as it sees them: waiting for them at start-up (logged, abandoned on SIGTERM),
and the drafter's health (its checked ModelInfo, the retry window after a failure, reconnecting).

The verifier is required: the gateway does not serve without it. The drafter is optional: while it
is down, requests of the drafter modes fall back to plain AR through the verifier (`fallback = "ar"`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import structlog

from core.errors import SpecdecError, StatusCode
from core.wire import SPECIAL_ID_FIELDS
from gateway.config import GatewayConfig
from gateway.peer_streams import PeerChannel
from gateway.remote import CallOptions, RemoteDrafter, fetch_drafter_info
from gateway.triton_verifier import TritonVerifierClient
from protos.specdec.v1 import common_pb2
from serving.channels import channel_options
from serving.tls import ClientTLS, open_channel

# Waiting for a peer at start-up: how often the wait looks at SIGTERM, and how often it is logged.
WAIT_POLL_S = 0.5
WAIT_LOG_S = 5.0


class StartAbandoned(Exception):
    """Start-up was given up (SIGTERM) while the gateway waited for a peer."""


class StartupWait:
    """Waits for peers at start-up, up to `timeout` seconds each, logging which peer and address it
    waits for every WAIT_LOG_S seconds; StartAbandoned once `abandon` is set."""

    def __init__(self, timeout: float, log, abandon: threading.Event) -> None:
        self.timeout = timeout
        self.log = log
        self.abandon = abandon

    def ready(self, channel: grpc.Channel, peer: str, address: str | None) -> None:
        """Until `channel` connects; grpc.FutureTimeoutError past the timeout."""
        future = grpc.channel_ready_future(channel)
        poll = self.poller(peer, address)
        try:
            while True:
                try:
                    future.result(timeout=WAIT_POLL_S)
                    return
                except grpc.FutureTimeoutError:
                    poll()
        finally:
            future.cancel()

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
    """The drafter service: its channels (a synchronous one for GetModelInfo from worker threads, a
    grpc.aio one for the session streams), its ModelInfo once checked against the verifier's, and
    the retry window: after a failed attempt it is skipped for `drafter_retry_s`, then tried again."""

    def __init__(self, config: GatewayConfig, tls: ClientTLS | None, on_fallback: Callable[[], None]) -> None:
        assert config.drafter_address
        self.address = config.drafter_address
        self.config = config
        self.channel = open_channel(self.address, tls, channel_options())
        self.streams = PeerChannel(self.address, tls, channel_options())
        self.info: common_pb2.ModelInfo | None = None
        self._on_fallback = on_fallback
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self.log = structlog.get_logger(service="gateway")

    def check_at_start(self, verifier: common_pb2.ModelInfo, wait: StartupWait) -> None:
        """Wait for the drafter and check it against the verifier; unreachable is an error only with
        `fallback = "fail"` (else the gateway starts, and reconnects on a later request)."""
        try:
            wait.ready(self.channel, "drafter", self.address)
            info = fetch_drafter_info(self.channel, timeout=wait.timeout)
        except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
            if self.config.fallback != "ar":
                raise SpecdecError(StatusCode.UNAVAILABLE, f"drafter at {self.address}: {exc}") from None
            self.log.warning("drafter_unreachable_at_start", address=self.address)
            return
        self._accept(info, verifier)

    def for_request(self, options: CallOptions, verifier: common_pb2.ModelInfo) -> RemoteDrafter | None:
        """The drafter for one request, or None while it is down (then the request falls back)."""
        with self._lock:
            if time.monotonic() < self._retry_at:
                return None
            if self.info is None:  # down at start-up: reconnect now that it may be back
                try:
                    self._accept(fetch_drafter_info(self.channel, timeout=1.0), verifier)
                    self.log.info("drafter_reconnected")
                except grpc.RpcError:
                    self._retry_at = time.monotonic() + self.config.drafter_retry_s
                    return None
            info = self.info
        return RemoteDrafter(self.streams, info, options, self.config.drafter_timeout_s)

    def failed(self, exc: Exception, log) -> None:
        """A real attempt at the drafter failed: skip it for drafter_retry_s, then try again."""
        with self._lock:
            self._retry_at = time.monotonic() + self.config.drafter_retry_s
        log.warning("drafter_failed_fallback_to_ar", error=str(exc))
        self._on_fallback()

    def skipped(self, log) -> None:
        """A request went without the drafter inside the retry window."""
        # No attempt was made, so the window must not move: under steady traffic, extending it on
        # every request would never let the drafter back in.
        log.info("drafter_down_fallback_to_ar")
        self._on_fallback()

    async def close(self) -> None:
        self.channel.close()
        await self.streams.close()

    def _accept(self, info: common_pb2.ModelInfo, verifier: common_pb2.ModelInfo) -> None:
        mismatch = [
            name
            for name in ("vocab_size", "tokenizer_fingerprint", *SPECIAL_ID_FIELDS)
            if getattr(info, name) != getattr(verifier, name)
        ]
        if mismatch:
            raise ValueError(f"drafter and verifier disagree on {', '.join(mismatch)}; refusing to combine them")
        self.info = info
