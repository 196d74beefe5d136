"""The gateway's verifier and drafter pools: where each request's sessions go, behind one interface.

A pool answers four questions for the request path (`gateway.server`, `gateway.peers.failover`):
when is it ready (`wait_ready`, at start-up), where does a new session go (`lease`: a verifier or
drafter for this request, and the place it runs), what happens when a place failed (`failed`), and
how many sessions it can hold (`session_budget`, for admission). Two kinds implement it:

- `ReplicaPool`: the replicas an address list or `dns:` name gives (`gateway.peers.replicas`), for
  the verifier and the drafter alike; a failed replica is skipped for a retry window, and a request
  may fail over to another one (`failover = True`).
- `TritonPool`: the one Triton-hosted verifier (`verifier_url = "triton://..."`,
  `gateway.peers.triton`); nothing to fail over to (`failover = False`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import structlog

from core.errors import SpecdecError, StatusCode
from core.wire import SPECIAL_ID_FIELDS
from gateway.config import GatewayConfig, verifier_of
from gateway.metrics import GatewayMetrics
from gateway.peers.calls import CallOptions
from gateway.peers.remote import RemoteDrafter, RemoteVerifier
from gateway.peers.replicas import Check, Replica, ReplicaSet
from gateway.peers.startup import StartupWait
from gateway.peers.triton import TritonVerifierClient
from protos.specdec.v1 import common_pb2
from serving.tls import ClientTLS


class Place(Protocol):
    """Where a leased session runs: a replica, or the Triton server."""

    address: str


class Pool(Protocol):
    """The verifier pool or the drafter pool of a gateway (see the module docstring)."""

    role: str
    spec: str  # the configured address(es), for messages
    failover: bool  # whether a request whose place failed may go on at another one

    async def start(self) -> None:
        """Begin finding and watching the places (on the gateway's event loop)."""

    def wait_ready(self, wait: StartupWait) -> common_pb2.ModelInfo | None:
        """Block (a worker thread) until a place is usable, within the start-up timeout: its ModelInfo,
        or None when an optional pool has none yet. Raises SpecdecError (UNAVAILABLE) or ValueError
        (every place refused, with the reasons)."""

    def lease(self, options: CallOptions, exclude: Collection[str]) -> contextlib.AbstractContextManager[Any]:
        """(the peer for this request, its `Place`) for as long as the block runs, or None when no
        usable place outside `exclude` is left."""

    def failed(self, place: Place, error: Exception) -> None:
        """A session at `place` failed: keep new sessions away from it for a while."""

    def usable(self) -> list[str]:
        """The addresses of the places a new session may go to now."""

    def session_budget(self) -> int:
        """Sessions the usable places hold together (0: unknown)."""

    async def close(self) -> None: ...


# (replica, its accepted ModelInfo, the request's call options) -> the Verifier or Drafter for the request.
MakePeer = Callable[[Replica, common_pb2.ModelInfo, CallOptions], Any]


def verifier_pool(config: GatewayConfig, tls: ClientTLS | None, check: Check, metrics: GatewayMetrics) -> Pool:
    """The pool `[gateway] verifier_url` / `verifier_address` names; `check` says why a verifier may
    not serve this gateway (None: it may)."""
    target = verifier_of(config)
    runs = (config.greedy_chunk, config.stream_greedy_chunk)
    if target.kind == "triton":
        return TritonPool(target.address, target.model, check, runs)

    def make(replica: Replica, info: common_pb2.ModelInfo, options: CallOptions) -> RemoteVerifier:
        return RemoteVerifier(replica.channel, info, options, *runs)

    policy = ReplicaPolicy(required=True, retry_s=config.replica_retry_s)
    return ReplicaPool("verifier", target.address, tls, check, metrics, config.resolve_interval_s, policy, make)


def drafter_pool(
    config: GatewayConfig, tls: ClientTLS | None, metrics: GatewayMetrics,
    verifier_info: Callable[[], common_pb2.ModelInfo | None],
) -> Pool | None:
    """The drafter replicas `[gateway] drafter_address` names (None: no drafter), each checked against
    the verifier's ModelInfo (`verifier_info()`, known once the verifier pool is ready). Optional
    unless `fallback = "fail"`: while none is up, the drafter modes fall back to AR."""
    if not config.drafter_address:
        return None

    def check(info: common_pb2.ModelInfo) -> str | None:
        verifier = verifier_info()
        assert verifier is not None
        mismatch = [name for name in ("vocab_size", "source_vocab_size", "tokenizer_fingerprint", *SPECIAL_ID_FIELDS)
                    if getattr(info, name) != getattr(verifier, name)]
        if mismatch:
            return f"drafter and verifier disagree on {', '.join(mismatch)}; refusing to combine them"
        return None

    def make(replica: Replica, info: common_pb2.ModelInfo, options: CallOptions) -> RemoteDrafter:
        return RemoteDrafter(replica.channel, info, options, config.drafter_timeout_s)

    policy = ReplicaPolicy(required=config.fallback != "ar", retry_s=config.drafter_retry_s)
    return ReplicaPool("drafter", config.drafter_address, tls, check, metrics, config.resolve_interval_s, policy,
                       make)


@dataclass(frozen=True)
class ReplicaPolicy:
    """How a replica pool behaves: `required` (start-up fails without a replica; else it starts and
    uses replicas as they come), and how long a failed replica is skipped."""

    required: bool
    retry_s: float


class ReplicaPool:
    """A role's replicas (`gateway.peers.replicas.ReplicaSet`) as a `Pool`."""

    failover = True

    def __init__(
        self, role: str, spec: str, tls: ClientTLS | None, check: Check, metrics: GatewayMetrics,
        resolve_interval_s: float, policy: ReplicaPolicy, make: MakePeer,
    ) -> None:
        self.role = role
        self.spec = spec
        self.policy = policy
        self.replicas = ReplicaSet(role, spec, tls, check, metrics, resolve_interval_s)
        self._make = make
        self.log = structlog.get_logger(service="gateway").bind(peer=role)

    async def start(self) -> None:
        await self.replicas.start()

    def wait_ready(self, wait: StartupWait) -> common_pb2.ModelInfo | None:
        try:
            usable = wait.replicas(self.replicas, self.role)
        except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
            why = str(exc) or f"no replica SERVING within {wait.timeout}s"
            if self.policy.required:
                raise SpecdecError(StatusCode.UNAVAILABLE, f"{self.role} at {self.spec}: {why}") from None
            self.log.warning(f"{self.role}_unreachable_at_start", address=self.spec)
            return None
        self.log.info(f"{self.role}_replicas", usable=usable, address=self.spec)
        return self.replicas.reference

    @contextlib.contextmanager
    def lease(self, options: CallOptions, exclude: Collection[str]) -> Iterator[tuple[Any, Replica] | None]:
        with self.replicas.lease(exclude) as replica:
            if replica is None or replica.info is None:
                yield None
                return
            yield self._make(replica, replica.info, options), replica

    def failed(self, place: Place, error: Exception) -> None:
        assert isinstance(place, Replica)
        self.replicas.failed(place, self.policy.retry_s, error)

    def usable(self) -> list[str]:
        return self.replicas.usable()

    def session_budget(self) -> int:
        return self.replicas.session_budget()

    async def close(self) -> None:
        await self.replicas.close()


@dataclass(frozen=True)
class TritonPlace:
    address: str


class TritonPool:
    """The Triton-hosted verifier as a `Pool`: one place, always leased, never failed over from."""

    role = "verifier"
    failover = False

    def __init__(self, address: str, model: str, check: Check, greedy_runs: tuple[int, int]) -> None:
        self.spec = f"triton://{address}/{model}"
        self.client = TritonVerifierClient(address, model)
        self.place = TritonPlace(address)
        self.info: common_pb2.ModelInfo | None = None
        self._check = check
        self._runs = greedy_runs  # AR steps a round trip, for a request and a streaming one

    async def start(self) -> None:
        """Nothing to watch: the server is asked for the model at `wait_ready`."""

    def wait_ready(self, wait: StartupWait) -> common_pb2.ModelInfo:
        try:
            info = wait.triton_info(self.client, self.place.address)
        except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
            why = str(exc) or f"not ready within {wait.timeout}s"
            raise SpecdecError(StatusCode.UNAVAILABLE, f"verifier at {self.place.address}: {why}") from None
        reason = self._check(info)
        if reason:
            raise ValueError(reason)
        self.info = info
        return info

    @contextlib.contextmanager
    def lease(self, options: CallOptions, exclude: Collection[str]) -> Iterator[tuple[Any, TritonPlace] | None]:
        assert self.info is not None
        yield self.client.verifier(self.info, options, *self._runs), self.place

    def failed(self, place: Place, error: Exception) -> None:
        """One server, no failover: the request's error goes back to its client."""

    def usable(self) -> list[str]:
        return [self.place.address] if self.info is not None else []

    def session_budget(self) -> int:
        return self.info.max_sessions if self.info else 0

    async def close(self) -> None:
        self.client.close()
