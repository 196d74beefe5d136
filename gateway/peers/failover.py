"""One request's decoding over the replica sets, moving to another replica when one fails.

Each attempt leases a verifier replica (and, for the drafter modes, a drafter replica) from the
sets (`gateway.peers.replicas`) and runs `decode()`. When the verifier replica fails mid-request (it died,
drains, or answers a failure status), the next attempt continues on another verifier replica from
the output committed so far (`decode(..., prefix=committed)`), so the lossless modes give the same
output and what was streamed stays one sequence. When the drafter replica fails, the next attempt
takes another drafter replica; with none left the request goes on as plain AR (`degraded`) or,
with `fallback = "fail"`, fails. A request fails UNAVAILABLE only when no verifier replica it has
not already failed on is usable.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from core.errors import SpecdecError, StatusCode
from core.interfaces import Verifier
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.modes import DRAFTER_MODES
from decoding.policies.loop import DecodeResult, OnTokens
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.peers.calls import CallOptions, DrafterFailure, RemoteCallError, RequestDeadlineExceeded
from gateway.peers.replicas import Replica, ReplicaSet
from gateway.peers.startup import DrafterPeer

# A peer's answer that is the replica's trouble, not the request's: another replica may do better.
_REPLICA_CODES = (StatusCode.UNAVAILABLE, StatusCode.RESOURCE_EXHAUSTED)


@dataclass(frozen=True)
class Peers:
    """What a request decodes through: the verifier replicas (None: the one Triton-hosted verifier,
    made by `make_verifier(None, options)`), the drafter (None: no drafter configured)."""

    config: GatewayConfig
    metrics: GatewayMetrics
    verifiers: ReplicaSet | None
    drafter: DrafterPeer | None
    make_verifier: Callable[[Replica | None, CallOptions], Verifier]


def decode_on_replicas(
    peers: Peers, source: list[int], config: DecodingConfig, options: CallOptions, on_tokens: OnTokens, log,
    first: list[int],
) -> DecodeResult:
    """Decode `source` (worker thread), failing over between replicas. `first`: the output's forced
    first tokens (a target language), committed before decoding and streamed like any other."""
    committed: list[int] = []

    def counting(block: list[int]) -> None:
        on_tokens(block)
        committed.extend(block)

    if first:
        counting(first)
    tried_verifiers: set[str] = set()
    tried_drafters: set[str] = set()
    wants_drafter = config.mode in DRAFTER_MODES
    degraded = False
    last_failure: Exception | None = None
    while True:
        with _lease_verifier(peers, tried_verifiers, last_failure) as replica:
            verifier = peers.make_verifier(replica, options)
            with _lease_drafter(peers, options, tried_drafters, wants_drafter) as leased:
                run = config
                if wants_drafter and leased is None:
                    _fall_back(peers, log, tried_drafters)
                    wants_drafter, degraded = False, True
                if degraded:
                    run = dataclasses.replace(config, mode=Mode.AR)
                drafter, drafter_replica = leased or (None, None)
                try:
                    # A copy: `counting` extends `committed` while the loop reads its prefix.
                    result = decode(source, run, verifier, drafter, counting, prefix=list(committed) or None)
                except DrafterFailure as exc:
                    assert peers.drafter is not None and drafter_replica is not None
                    peers.drafter.failed(drafter_replica, exc.cause)
                    tried_drafters.add(drafter_replica.address)
                    continue
                except (SpecdecError, RemoteCallError) as exc:
                    if replica is None or peers.verifiers is None or not _replica_failure(exc):
                        raise
                    peers.verifiers.failed(replica, peers.config.replica_retry_s, exc)
                    tried_verifiers.add(replica.address)
                    peers.metrics.failovers.inc(role="verifier")
                    log.warning("verifier_failover", replica=replica.address, committed=len(committed),
                                error=str(exc))
                    last_failure = exc
                    continue
        result.stats.degraded = degraded
        return result


@contextlib.contextmanager
def _lease_verifier(peers: Peers, tried: set[str], last_failure: Exception | None) -> Iterator[Replica | None]:
    if peers.verifiers is None:  # the Triton-hosted verifier: one, no failover
        yield None
        return
    with peers.verifiers.lease(tried) as replica:
        if replica is None:
            why = f"; the last one failed: {last_failure}" if last_failure else ""
            raise SpecdecError(StatusCode.UNAVAILABLE, f"no verifier replica is serving ({peers.verifiers.spec}){why}")
        yield replica


@contextlib.contextmanager
def _lease_drafter(peers: Peers, options: CallOptions, tried: set[str], wanted: bool) -> Iterator:
    """(RemoteDrafter, its replica) for this attempt, or None (not wanted, or none usable)."""
    if not wanted or peers.drafter is None:
        yield None
        return
    with peers.drafter.lease(options, tried) as leased:
        if leased is not None and tried:
            peers.metrics.failovers.inc(role="drafter")
        yield leased


def _fall_back(peers: Peers, log, tried: set[str]) -> None:
    """No drafter for a drafter mode: plain AR from here (`fallback = "ar"`), else UNAVAILABLE."""
    why = "the drafter replicas failed" if tried else "the drafter is down"
    if peers.drafter is None:
        why = "no drafter is configured"
    if peers.config.fallback != "ar":
        raise SpecdecError(StatusCode.UNAVAILABLE, f"no fallback configured: {why}")
    if tried:
        log.warning("drafter_failed_fallback_to_ar")
    else:
        log.info("drafter_down_fallback_to_ar")
    peers.metrics.degraded.inc()


def _replica_failure(exc: Exception) -> bool:
    if isinstance(exc, RequestDeadlineExceeded):  # the request's own deadline: no replica is at fault
        return False
    return isinstance(exc, RemoteCallError) or (isinstance(exc, SpecdecError) and exc.code in _REPLICA_CODES)
