"""Waiting for the gateway's peers at start-up: logged while it waits, abandoned on SIGTERM.

The pools (`gateway.peers.pools`) wait through it: the verifier is required (the gateway does not
serve without it); the drafter is optional (while it is down, requests of the drafter modes fall back
to plain AR through the verifier, `fallback = "ar"`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from core.errors import SpecdecError
from gateway.peers.replicas import ReplicaSet
from gateway.peers.triton import TritonVerifierClient
from protos.specdec.v1 import common_pb2

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
