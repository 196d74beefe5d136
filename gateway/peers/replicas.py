"""A replica set: the verifier (or drafter) servers one `[gateway] verifier_address` /
`drafter_address` names, each watched, and the choice of replica for each new session.

The address is a comma-separated list of gRPC targets, each either one server (`host:port`,
`unix:PATH`) or a `dns:` name standing for every address it resolves to (`gateway.peers.dns`; a
Kubernetes headless Service). Names are resolved again every `resolve_interval_s`: an address
that appears becomes a replica, one that is gone takes no new sessions and its channel closes
once its sessions have ended.

Each replica has a channel of its own and is watched through the gRPC health service's `Watch`
stream for its role's service: it takes sessions while it reports SERVING and its `GetModelInfo`
passed the set's check (the first accepted replica's bundle fingerprint, and the caller's check:
the tokenizer, the verifier's ids). NOT_SERVING (warming up, draining) or a broken watch (the
process died) takes it out at once; a session that failed on it keeps it out for `retry_s`.

Placement (`lease`): the usable replica with the most free sessions, counted as its `max_sessions`
less the sessions this gateway holds on it; ties go to the one picked longest ago. Other
gateways' sessions are not seen here; a replica they filled refuses a session with
RESOURCE_EXHAUSTED, which the request's failover answers by moving to another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.metrics import GatewayMetrics
from gateway.peers.dns import DnsName, parse_targets, resolve
from gateway.peers.streams import PeerChannel
from protos.specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from serving.channels import channel_options
from serving.tls import ClientTLS

# After its watch broke (the replica is down or unreachable), how long before watching again; the
# channel's own reconnect backoff (serving.channels) keeps a restarted replica's return within seconds.
WATCH_RETRY_S = 0.5
INFO_TIMEOUT_S = 5.0
# Free sessions of a replica that reports no max_sessions (an older server): plenty, less what it holds.
_UNKNOWN_MAX = 1 << 20

SERVICES = {"verifier": "specdec.v1.VerifierService", "drafter": "specdec.v1.DrafterService"}

# (replica info) -> None when the replica may serve, else why not (logged, the replica refused).
Check = Callable[[common_pb2.ModelInfo], str | None]


@dataclass(eq=False)
class Replica:
    """One server of the set, as this gateway sees it."""

    address: str
    channel: PeerChannel
    serving: bool = False  # its health watch says SERVING
    info: common_pb2.ModelInfo | None = None  # checked and accepted (None: not yet, or refused)
    refused: str | None = None
    retry_at: float = 0.0  # a session failed on it: no new session before this (time.monotonic)
    sessions: int = 0  # sessions this gateway holds on it
    picked_at: float = 0.0
    leaving: bool = False  # resolved no more: no new sessions, closed once they ended
    name: DnsName | None = None  # the dns: name it was resolved from (None: listed itself)
    watch: asyncio.Task | None = field(default=None, repr=False)

    def usable(self, now: float) -> bool:
        return self.healthy() and now >= self.retry_at

    def healthy(self) -> bool:
        """SERVING, accepted and still resolved, whether or not a session just failed on it."""
        return self.serving and self.info is not None and not self.leaving

    def free(self) -> int:
        return (self.info.max_sessions if self.info and self.info.max_sessions else _UNKNOWN_MAX) - self.sessions


class ReplicaSet:
    """The replicas of one role. `start()` and `close()` run on the gateway's event loop; `lease`,
    `failed` and the read-outs are called from any thread."""

    def __init__(
        self, role: str, spec: str, tls: ClientTLS | None, check: Check, metrics: GatewayMetrics,
        resolve_interval_s: float,
    ) -> None:
        self.role = role
        self.spec = spec
        self.targets = parse_targets(spec, f"{role}_address")
        self.tls = tls
        self.check = check
        self.metrics = metrics
        self.resolve_interval_s = resolve_interval_s
        self.reference: common_pb2.ModelInfo | None = None  # the first accepted replica's
        self.replicas: dict[str, Replica] = {}
        self._leaving: list[Replica] = []
        self._name_of: dict[str, DnsName] = {}  # resolved address -> the name it came from
        self._lock = threading.Lock()
        self._refresh: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()
        self._closed = False
        self.log = structlog.get_logger(service="gateway").bind(peer=role)

    # ---- from any thread -------------------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self, exclude: Collection[str] = ()) -> Iterator[Replica | None]:
        """The replica a new session goes to (None: no usable one outside `exclude`), its session
        counted on it for as long as the block runs."""
        with self._lock:
            now = time.monotonic()
            usable = [r for r in self.replicas.values() if r.usable(now) and r.address not in exclude]
            if not usable:
                # Every healthy replica is held out after a failed session (with one replica, after
                # any): try one anyway rather than refuse this request for another's failure.
                usable = [r for r in self.replicas.values() if r.healthy() and r.address not in exclude]
            chosen = max(usable, key=lambda r: (r.free(), -r.picked_at), default=None)
            if chosen is not None:
                chosen.sessions += 1
                chosen.picked_at = now
        if chosen is None:
            yield None
            return
        self.metrics.replica_requests.inc(role=self.role, replica=chosen.address)
        self.metrics.replica_sessions.set(chosen.sessions, role=self.role, replica=chosen.address)
        try:
            yield chosen
        finally:
            with self._lock:
                chosen.sessions -= 1
            self.metrics.replica_sessions.set(chosen.sessions, role=self.role, replica=chosen.address)

    def failed(self, replica: Replica, retry_s: float, error: object) -> None:
        """A session on `replica` failed: no new session goes there for `retry_s` (its health watch
        takes it out for longer when it is down)."""
        with self._lock:
            replica.retry_at = time.monotonic() + retry_s
        self.metrics.replica_failures.inc(role=self.role, replica=replica.address)
        self.log.warning("replica_failed", replica=replica.address, error=str(error), retry_s=retry_s)

    def usable(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return sorted(r.address for r in self.replicas.values() if r.usable(now))

    def refusals(self) -> list[str]:
        """Why replicas were refused, while every replica known is refused (else [])."""
        with self._lock:
            known = list(self.replicas.values())
        if known and all(r.refused for r in known):
            return sorted({r.refused for r in known if r.refused})
        return []

    def session_budget(self) -> int:
        """The usable replicas' max_sessions together (0: unknown, one does not report it)."""
        now = time.monotonic()
        with self._lock:
            sizes = [r.info.max_sessions for r in self.replicas.values() if r.usable(now) and r.info]
        return 0 if not sizes or 0 in sizes else sum(sizes)

    # ---- on the event loop -----------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve the targets, start watching every replica, and keep resolving."""
        await self._resolve()
        self._refresh = asyncio.ensure_future(self._keep_resolving())

    async def close(self) -> None:
        self._closed = True
        if self._refresh is not None:
            self._refresh.cancel()
        for replica in [*self.replicas.values(), *self._leaving]:
            await self._close(replica)
        self.replicas.clear()
        self._leaving.clear()

    async def _keep_resolving(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.resolve_interval_s)
            await self._resolve()

    async def _resolve(self) -> None:
        addresses: list[str] = []
        for target in self.targets:
            if isinstance(target, str):
                addresses.append(target)
                continue
            try:
                resolved = await resolve(target)
            except (OSError, TimeoutError) as exc:  # keep what this name had: a DNS hiccup drops nothing
                self.log.warning("resolve_failed", name=target.text, error=str(exc) or type(exc).__name__)
                resolved = [a for a, r in self.replicas.items() if r.name == target]
            for address in resolved:
                self._name_of[address] = target
            addresses += resolved
        self._reconcile(list(dict.fromkeys(addresses)))

    def _reconcile(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self.replicas:
                name = self._name_of.get(address)
                replica = Replica(address, PeerChannel(address, self.tls, self._options(name)), name=name)
                with self._lock:
                    self.replicas[address] = replica
                replica.watch = asyncio.ensure_future(self._watch(replica))
                self.log.info("replica_added", replica=address)
        for address in [a for a in self.replicas if a not in addresses]:
            with self._lock:
                replica = self.replicas.pop(address)
                replica.leaving = True
            self._leaving.append(replica)
            self.metrics.replica_usable.set(0, role=self.role, replica=address)
            self.log.info("replica_removed", replica=address, sessions=replica.sessions)
        for replica in [r for r in self._leaving if r.sessions == 0]:
            self._leaving.remove(replica)
            closing = asyncio.ensure_future(self._close(replica))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def _options(self, name: DnsName | None) -> list:
        options = channel_options()
        if name is not None and self.tls is not None:  # the certificate names the DNS name, not the IP
            options.append(("grpc.ssl_target_name_override", name.host))
        return options

    async def _close(self, replica: Replica) -> None:
        if replica.watch is not None:
            replica.watch.cancel()
        await replica.channel.close()

    async def _watch(self, replica: Replica) -> None:
        """Follow the replica's health; on each change to SERVING, fetch and check its ModelInfo."""
        health = health_pb2_grpc.HealthStub(replica.channel.channel)
        request = health_pb2.HealthCheckRequest(service=SERVICES[self.role])
        while not self._closed and not replica.leaving:
            try:
                async for answer in health.Watch(request):
                    serving = answer.status == health_pb2.HealthCheckResponse.SERVING
                    if serving and not replica.serving:
                        self._accept(replica, await self._fetch_info(replica))
                    self._set_serving(replica, serving)
            except grpc.aio.AioRpcError:
                pass  # down, unreachable or gone: watched again below
            self._set_serving(replica, False)
            await asyncio.sleep(WATCH_RETRY_S)

    async def _fetch_info(self, replica: Replica) -> common_pb2.ModelInfo:
        if self.role == "verifier":
            stub = verifier_pb2_grpc.VerifierServiceStub(replica.channel.channel)
            reply = await stub.GetModelInfo(verifier_pb2.VerifierServiceGetModelInfoRequest(), timeout=INFO_TIMEOUT_S)
        else:
            stub = drafter_pb2_grpc.DrafterServiceStub(replica.channel.channel)
            reply = await stub.GetModelInfo(drafter_pb2.DrafterServiceGetModelInfoRequest(), timeout=INFO_TIMEOUT_S)
        return reply.model_info

    def _accept(self, replica: Replica, info: common_pb2.ModelInfo) -> None:
        reason = self.check(info)
        first = self.reference
        if reason is None and first is not None and info.bundle_fingerprint != first.bundle_fingerprint:
            reason = (f"it serves bundle {info.bundle_fingerprint[:16]}, the first {self.role} replica "
                      f"{first.bundle_fingerprint[:16]}")
        with self._lock:
            replica.refused = reason
            replica.info = None if reason else info
            if reason is None and self.reference is None:
                self.reference = info
        if reason:
            self.log.error("replica_refused", replica=replica.address, reason=reason)

    def _set_serving(self, replica: Replica, serving: bool) -> None:
        if serving == replica.serving:
            return
        with self._lock:
            replica.serving = serving
        usable = serving and replica.info is not None and not replica.leaving
        self.metrics.replica_usable.set(int(usable), role=self.role, replica=replica.address)
        self.log.info("replica_serving" if serving else "replica_not_serving", replica=replica.address,
                      usable=self.usable())
