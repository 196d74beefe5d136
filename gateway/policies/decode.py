"""One entry point for every mode: `decode(source_ids, config, verifier, drafter)`."""

from __future__ import annotations

from functools import partial

import numpy as np

from core.checks import check_ids
from core.errors import SpecdecError, StatusCode, invalid, out_of_range
from core.interfaces import Draft, Drafter, DrafterSession, Verifier, VerifyResult
from core.sampling import SamplingParams
from gateway.decoding_config import DRAFTER_MODES, DecodingConfig, Mode
from gateway.policies.accept import accept_exact, accept_gad_plus_plus, accept_mjsd, accept_speculative
from gateway.policies.beam import beam_search
from gateway.policies.iad import CopyDrafter
from gateway.policies.loop import (
    Accept,
    DecodeResult,
    DecodeStats,
    OnTokens,
    PrefixSync,
    Propose,
    draft_verify_loop,
)


def decode(
    source_ids: list[int],
    config: DecodingConfig,
    verifier: Verifier,
    drafter: Drafter | None = None,
    on_tokens: OnTokens | None = None,
    rng: np.random.Generator | None = None,
    prefix: list[int] | None = None,
) -> DecodeResult:
    """Decode one source with the configured mode. `rng` (sampling modes) defaults to one seeded
    from `config.seed`; pass one in to draw many samples from a single stream. `prefix` continues
    an output already committed (a fallback after the drafter failed mid-request); the result
    includes it."""
    _check_source(source_ids, verifier)
    if prefix and config.mode == Mode.BEAM:
        raise invalid("beam search cannot continue a committed prefix")
    check_ids(prefix or [], verifier.vocab_size, "prefix")
    if prefix and len(prefix) >= config.max_new_tokens:
        raise out_of_range(f"prefix has {len(prefix)} tokens; max_new_tokens is {config.max_new_tokens}")
    stats = DecodeStats()
    mode = config.mode
    if mode == Mode.BEAM:
        out = beam_search(
            verifier,
            source_ids,
            config.num_beams,
            config.max_new_tokens,
            stats,
            delta=config.beam_delta,
            max_candidates=config.beam_max_candidates,
        )
        if on_tokens is not None and out:
            on_tokens(out)
        return DecodeResult(out, stats)
    if mode in DRAFTER_MODES and drafter is None:
        raise SpecdecError(StatusCode.FAILED_PRECONDITION, f"mode {mode.value} needs a drafter")
    if rng is None:
        rng = np.random.default_rng([config.seed, 0])
    session = verifier.open(source_ids)
    drafter_session: DrafterSession | None = None
    try:
        if mode in DRAFTER_MODES:
            assert drafter is not None
            drafter_seed = int(np.random.SeedSequence([config.seed, 1]).generate_state(1)[0])
            drafter_session = drafter.open(source_ids, seed=drafter_seed)
        propose, accept, top_k = _policy(config, source_ids, verifier, drafter_session, rng)
        out = draft_verify_loop(
            session, propose, accept, top_k, config.max_new_tokens, verifier.eos_id, stats, on_tokens, prefix
        )
        return DecodeResult(out, stats)
    finally:
        session.close()
        if drafter_session is not None:
            drafter_session.close()


def _policy(
    config: DecodingConfig,
    source_ids: list[int],
    verifier: Verifier,
    drafter_session: DrafterSession | None,
    rng: np.random.Generator,
) -> tuple[Propose, Accept, int]:
    """(propose, accept, top_k) for a draft-verify mode."""
    mode = config.mode
    if mode == Mode.AR:
        return _no_draft, _exact, 1
    if mode == Mode.IAD:
        copier = CopyDrafter(source_ids, verifier.bos_id, verifier.eos_id, cap=config.k)
        return copier.propose, _exact, 1
    assert drafter_session is not None
    sync = _DrafterSync(drafter_session)
    if mode == Mode.GAD:
        return partial(sync.block, k=config.k), _exact, 1
    if mode == Mode.GAD_PLUS_PLUS:

        def gad_plus_plus(ids: list[int], draft: Draft, res: VerifyResult) -> tuple[int, int]:
            return accept_gad_plus_plus(ids, res, config.beta, config.tau)

        return partial(sync.block, k=config.k), gad_plus_plus, config.beta
    if mode == Mode.MJSD:

        def mjsd(ids: list[int], draft: Draft, res: VerifyResult) -> tuple[int, int]:
            return accept_mjsd(ids, draft.cum_logq, res, config.threshold)

        return partial(sync.beam, gamma=config.gamma, num_beams=config.num_beams), mjsd, 1
    if mode == Mode.SPECULATIVE:
        params = config.sampling

        def speculative(ids: list[int], draft: Draft, res: VerifyResult) -> tuple[int, int]:
            return accept_speculative(ids, draft.q_rows, res, params, verifier.vocab_size, rng)

        # The residual max(0, p - q) needs p over the whole vocabulary.
        return partial(sync.sample, gamma=config.gamma, params=params), speculative, verifier.vocab_size
    raise invalid(f"mode {mode.value} is not a draft-verify mode")


def _no_draft(output: list[int], room: int) -> Draft:
    return Draft(ids=[])


def _exact(ids: list[int], draft: Draft, res: VerifyResult) -> tuple[int, int]:
    return accept_exact(ids, res)


class _DrafterSync:
    """Sends the drafter only the delta of the committed output at every step."""

    def __init__(self, session: DrafterSession) -> None:
        self.session = session
        self.sync = PrefixSync()

    def _delta(self, output: list[int]) -> tuple[int, list[int]]:
        committed, append = self.sync.delta(output)
        self.sync.seen = list(output)
        return committed, append

    def block(self, output: list[int], room: int, k: int) -> Draft:
        return self.session.draft_block(*self._delta(output), min(k, room))

    def beam(self, output: list[int], room: int, gamma: int, num_beams: int) -> Draft:
        return self.session.draft_beam(*self._delta(output), min(gamma, room), num_beams)

    def sample(self, output: list[int], room: int, gamma: int, params: SamplingParams) -> Draft:
        return self.session.draft_sample(*self._delta(output), min(gamma, room), params)


def _check_source(source_ids: list[int], verifier: Verifier) -> None:
    if not source_ids:
        raise invalid("input is empty")
    check_ids(source_ids, verifier.vocab_size, "input_ids")
    if len(source_ids) > verifier.max_source_len:
        raise out_of_range(f"input has {len(source_ids)} tokens; the limit is {verifier.max_source_len}")
