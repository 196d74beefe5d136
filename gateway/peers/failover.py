"""One request's decoding over the pools, moving to another place when one fails.

Each attempt leases a verifier (and, for the drafter modes, a drafter) from the pools
(`gateway.peers.pools`) and runs `decode()`. When the verifier's place fails mid-request (a replica
died, drains, or answers a failure status) and its pool can fail over, the next attempt continues at
another place from the output committed so far (`decode(..., prefix=committed)`), so the lossless
modes give the same output and what was streamed stays one sequence. When the drafter fails, the next
attempt takes another drafter replica; with none left the request goes on as plain AR (`degraded`)
or, with `fallback = "fail"`, fails. A request fails UNAVAILABLE only when no verifier place it has
not already failed at is usable.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from core.errors import SpecdecError, StatusCode
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.modes import DRAFTER_MODES
from decoding.policies.loop import DecodeResult, OnTokens, block_logprobs
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.peers.calls import CallOptions, DrafterFailure, RemoteCallError, RequestDeadlineExceeded
from gateway.peers.pools import Pool

# A peer's answer that is the place's trouble, not the request's: another replica may do better.
_REPLICA_CODES = (StatusCode.UNAVAILABLE, StatusCode.RESOURCE_EXHAUSTED)


@dataclass(frozen=True)
class Peers:
    """What a request decodes through: the verifier pool, and the drafter pool (None: no drafter
    is configured)."""

    config: GatewayConfig
    metrics: GatewayMetrics
    verifiers: Pool
    drafters: Pool | None


def decode_with_failover(
    peers: Peers, source: list[int], config: DecodingConfig, options: CallOptions, on_tokens: OnTokens, log,
    first: list[int],
) -> DecodeResult:
    """Decode `source` (worker thread), failing over between places. `first`: the output's forced
    first tokens (a target language), committed before decoding and streamed like any other."""
    committed: list[int] = []
    logprobs: list[float] = []  # of the committed tokens, for the next attempt to go on from

    def counting(block: list[int]) -> None:
        on_tokens(block)
        committed.extend(block)
        logprobs.extend(block_logprobs(block))

    if first:
        counting(first)
    tried_verifiers: set[str] = set()
    tried_drafters: set[str] = set()
    wants_drafter = config.mode in DRAFTER_MODES
    degraded = False
    last_failure: Exception | None = None
    while True:
        with (
            _lease_verifier(peers.verifiers, options, tried_verifiers, last_failure) as (verifier, place),
            _lease_drafter(peers, options, tried_drafters, wants_drafter) as leased,
        ):
            run = config
            if wants_drafter and leased is None:
                _fall_back(peers, log, tried_drafters)
                wants_drafter, degraded = False, True
            if degraded:
                run = dataclasses.replace(config, mode=Mode.AR)
            drafter, drafter_place = leased or (None, None)
            try:
                # A copy: `counting` extends `committed` while the loop reads its prefix.
                result = decode(source, run, verifier, drafter, counting, prefix=list(committed) or None,
                                prefix_logprobs=list(logprobs), forced_first=len(first))
            except DrafterFailure as exc:
                assert peers.drafters is not None and drafter_place is not None
                peers.drafters.failed(drafter_place, exc.cause)
                tried_drafters.add(drafter_place.address)
                continue
            except (SpecdecError, RemoteCallError) as exc:
                if not peers.verifiers.failover or not _place_failure(exc):
                    raise
                peers.verifiers.failed(place, exc)
                tried_verifiers.add(place.address)
                peers.metrics.failovers.inc(role="verifier")
                log.warning("verifier_failover", replica=place.address, committed=len(committed),
                            error=str(exc))
                last_failure = exc
                continue
        result.stats.degraded = degraded
        return result


@contextlib.contextmanager
def _lease_verifier(pool: Pool, options: CallOptions, tried: set[str], last_failure: Exception | None) -> Iterator:
    with pool.lease(options, tried) as leased:
        if leased is None:
            why = f"; the last one failed: {last_failure}" if last_failure else ""
            raise SpecdecError(StatusCode.UNAVAILABLE, f"no verifier replica is serving ({pool.spec}){why}")
        yield leased


@contextlib.contextmanager
def _lease_drafter(peers: Peers, options: CallOptions, tried: set[str], wanted: bool) -> Iterator:
    """(the drafter, its place) for this attempt, or None (not wanted, or none usable)."""
    if not wanted or peers.drafters is None:
        yield None
        return
    with peers.drafters.lease(options, tried) as leased:
        if leased is not None and tried:
            peers.metrics.failovers.inc(role="drafter")
        yield leased


def _fall_back(peers: Peers, log, tried: set[str]) -> None:
    """No drafter for a drafter mode: plain AR from here (`fallback = "ar"`), else UNAVAILABLE."""
    why = "the drafter replicas failed" if tried else "the drafter is down"
    if peers.drafters is None:
        why = "no drafter is configured"
    if peers.config.fallback != "ar":
        raise SpecdecError(StatusCode.UNAVAILABLE, f"no fallback configured: {why}")
    if tried:
        log.warning("drafter_failed_fallback_to_ar")
    else:
        log.info("drafter_down_fallback_to_ar")
    peers.metrics.degraded.inc()


def _place_failure(exc: Exception) -> bool:
    if isinstance(exc, RequestDeadlineExceeded):  # the request's own deadline: no place is at fault
        return False
    return isinstance(exc, RemoteCallError) or (isinstance(exc, SpecdecError) and exc.code in _REPLICA_CODES)
