"""AR beam search with the verifier: its own loop (`decoding.policies.beam`), not draft-verify.

One request holds one verifier session: its hypotheses are the rows of that session."""

from __future__ import annotations

from core.interfaces import Verifier
from decoding.config import DecodingConfig, Mode
from decoding.modes.mode_spec import DrafterMethod, ModeSpec, one_session
from decoding.policies.beam import beam_search
from decoding.policies.loop import DecodeStats


def run(
    source_ids: list[int], config: DecodingConfig, verifier: Verifier, stats: DecodeStats, prefix: list[int] | None,
) -> list[int]:
    return beam_search(
        verifier,
        source_ids,
        config.num_beams,
        config.max_new_tokens,
        stats,
        delta=config.beam_delta,
        max_candidates=config.beam_max_candidates,
        prefix=prefix,
    )


SPEC = ModeSpec(
    Mode.BEAM, wire="MODE_AR_BEAM", lossless=False, drafter=DrafterMethod.NONE, run=run, title="beam search",
    verifier_sessions=one_session,  # every live hypothesis is a row of one multi-row session
    params=frozenset({"num_beams", "beam_delta", "beam_max_candidates"}),
)
