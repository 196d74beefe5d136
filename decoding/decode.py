"""One entry point for every mode: `decode(source_ids, config, verifier, drafter)`.

It looks the mode up in the registry (`decoding.modes`) and runs its policy, built from the pieces
in `decoding.policies`, against the `Drafter` / `Verifier` interfaces."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np

from core.checks import check_ids, check_source_ids
from core.errors import SpecdecError, StatusCode, out_of_range
from core.interfaces import (
    CopyRunSession,
    Drafter,
    DrafterSession,
    Verifier,
    VerifierSession,
    draft_limit,
    greedy_run_limit,
    open_session,
)
from core.logits_processors import Processors
from decoding.config import DecodingConfig
from decoding.modes import MODES, PolicyInputs
from decoding.modes.mode_spec import ModeSpec
from decoding.policies.adaptive import LoadModel, load_model
from decoding.policies.drafter_sync import DrafterSync, LazyDrafterSession
from decoding.policies.greedy import greedy_loop
from decoding.policies.loop import Block, DecodeResult, DecodeStats, LoopOptions, OnTokens, draft_verify_loop
from decoding.policies.overlap import OverlappedSync, predraft_executor
from decoding.policies.preverify import PreVerify


def decode(
    source_ids: list[int],
    config: DecodingConfig,
    verifier: Verifier,
    drafter: Drafter | None = None,
    on_tokens: OnTokens | None = None,
    rng: np.random.Generator | None = None,
    prefix: list[int] | None = None,
    load: LoadModel | None = None,
    prefix_logprobs: list[float] | None = None,
    forced_first: int | None = None,
) -> DecodeResult:
    """Decode one source with the configured mode. `rng` (sampling modes) defaults to one seeded
    from `config.seed`; pass one in to draw many samples from a single stream. `prefix` continues
    an output already committed (forced first tokens, a target prefix, or a fallback after a peer
    failed mid-request); the result includes it, and `prefix_logprobs` are its tokens' log-probs
    (default 0 each, as forced tokens'); `forced_first`, how many of its first tokens were forced (a
    target language's code, a target prefix; default: all), after which begin_suppress_tokens apply.
    `load`: the load model adaptive speculation reads and learns (default: the one the verifier shares
    with every request on it; a caller may force a policy with its own)."""
    # Every request counts in its verifier's load while it decodes, whatever its mode: adaptive
    # speculation reads the load from there (decoding.policies.adaptive, "rows").
    load = load if load is not None else load_model(verifier)
    logprobs = list(prefix_logprobs) if prefix_logprobs is not None else [0.0] * len(prefix or [])
    if len(logprobs) != len(prefix or []):
        raise ValueError(f"{len(logprobs)} prefix log-probs for a prefix of {len(prefix or [])} tokens")
    processors = config.processors(len(prefix or []) if forced_first is None else forced_first)
    with load.decoding():
        result = _decode(source_ids, config, verifier, drafter, on_tokens, rng, prefix, load, logprobs, processors)
    if not config.output_logprobs:  # kept while decoding (a failover goes on from them), returned on request
        result.token_logprobs = []
        result.hypotheses = [dataclasses.replace(h, token_logprobs=[]) for h in result.hypotheses]
    return result


def _decode(
    source_ids: list[int],
    config: DecodingConfig,
    verifier: Verifier,
    drafter: Drafter | None,
    on_tokens: OnTokens | None,
    rng: np.random.Generator | None,
    prefix: list[int] | None,
    load: LoadModel,
    logprobs: list[float],
    processors: Processors,
) -> DecodeResult:
    # The in-process edge: what a caller controls is checked here; the sessions below trust it.
    check_source_ids(source_ids, verifier.source_vocab_size, verifier.max_source_len, what="input",
                     ids_name="input_ids")
    spec = MODES[config.mode]
    check_ids(prefix or [], verifier.vocab_size, "prefix")
    if prefix and len(prefix) >= config.max_new_tokens:
        raise out_of_range(f"prefix has {len(prefix)} tokens; max_new_tokens is {config.max_new_tokens}")
    stats = DecodeStats()
    if spec.run is not None:
        hypotheses = spec.run(source_ids, config, verifier, stats, prefix)
        best = hypotheses[0]
        out, before = best.output_ids, len(prefix or [])
        added = out[before:]  # the prefix was committed (and streamed) before
        if on_tokens is not None and added:
            on_tokens(Block(added, 0, best.token_logprobs[before : len(out)]))
        return DecodeResult(out, stats, hypotheses, [*logprobs, *best.token_logprobs[before:]])
    assert spec.build is not None
    if spec.needs_drafter and drafter is None:
        raise SpecdecError(StatusCode.FAILED_PRECONDITION, f"mode {config.mode.value} needs a drafter")
    if rng is None:
        rng = np.random.default_rng([config.seed, 0])
    session = open_session(verifier, source_ids, processors)
    drafter_session: DrafterSession | None = None
    try:
        if spec.needs_drafter:
            assert drafter is not None
            drafter_seed = int(np.random.SeedSequence([config.seed, 1]).generate_state(1)[0])
            if config.adaptive:  # may never draft (k = 0 under load): open the drafter on first use
                drafter_session = LazyDrafterSession(partial(drafter.open, source_ids, seed=drafter_seed))
            else:
                drafter_session = drafter.open(source_ids, seed=drafter_seed)
        sync: DrafterSync | None = None
        overlap: OverlappedSync | None = None
        preverify = _preverify(config, spec)
        if drafter_session is not None:
            max_block = draft_limit(drafter)
            if config.overlap and spec.overlap:
                sync = overlap = OverlappedSync(drafter_session, stats, verifier.eos_id, spec.realign, spec.lookahead,
                                                max_block)
            else:
                sync = DrafterSync(drafter_session, spec.realign, spec.lookahead, max_block)
        propose, accept = spec.build(PolicyInputs(config, source_ids, verifier, sync, rng, load))
        top_k = spec.top_k(config, verifier.vocab_size)
        if greedy_run_limit(session) > 1 and (spec.greedy or _copy_runs(spec, config, session)):
            out = greedy_loop(session, top_k, config.max_new_tokens, verifier.eos_id, stats, on_tokens, prefix,
                              logprobs, copy_k=0 if spec.greedy else config.k)
            return DecodeResult(out, stats, token_logprobs=logprobs)
        options = LoopOptions(
            top_k, config.max_new_tokens, verifier.eos_id, on_tokens=on_tokens, prefix=prefix, overlap=overlap,
            preverify=preverify, ahead=partial(_alone, load) if overlap or preverify else None,
            on_verdict=None if sync is None else sync.observe, logprobs=logprobs,
        )
        out = draft_verify_loop(session, propose, accept, stats, options)
        return DecodeResult(out, stats, token_logprobs=logprobs)
    finally:
        session.close()
        if drafter_session is not None:
            drafter_session.close()


# Drafting ahead (overlap, pre-verify) spends drafter and verifier work on guesses to cut one
# request's latency; with other requests in flight the guesses take forwards from them and it slowed
# them down (BENCHMARKS.md, "Overlapped drafting and pre-verify: notes"), so it runs only while no
# more than this many requests decode on the verifier, and the loop asks again every iteration.
AHEAD_MAX_IN_FLIGHT = 1


def _copy_runs(spec: ModeSpec, config: DecodingConfig, session: VerifierSession) -> bool:
    """Whether IAD runs on the verifier's side, a run per round trip (`CopyRunSession`): a mode of
    source copies, of a fixed block (adaptive speculation picks each block from the load it sees
    per iteration), on a session that can, for a whole output. A streaming request's session (its
    first runs short, for its first tokens) keeps the loop: its pieces are the loop's blocks, each
    told apart as drafted or the verifier's own."""
    return (spec.copy_runs and not config.adaptive and isinstance(session, CopyRunSession)
            and not session.first_greedy_runs)


def _alone(load: LoadModel) -> bool:
    return load.in_flight <= AHEAD_MAX_IN_FLIGHT


def _preverify(config: DecodingConfig, spec: ModeSpec) -> PreVerify | None:
    """Pre-verify for this request, if it asked for it and its mode has a rule at one position.
    Adaptive speculation, which chooses each block's length before drafting it, goes without."""
    if not config.preverify or spec.preverify is None or config.adaptive:
        return None
    return PreVerify(spec.preverify(config), predraft_executor())
