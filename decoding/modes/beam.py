"""AR beam search with the verifier: its own loop (`decoding.policies.beam`), not draft-verify.

One request holds one verifier session: its hypotheses are the rows of that session."""

from __future__ import annotations

from core.interfaces import Verifier
from decoding.config import DecodingConfig, Mode
from decoding.modes.mode_spec import DrafterMethod, ModeSpec, one_session
from decoding.policies.beam import BeamSettings, beam_search
from decoding.policies.loop import DecodeStats, Hypothesis


def run(
    source_ids: list[int], config: DecodingConfig, verifier: Verifier, stats: DecodeStats, prefix: list[int] | None,
) -> list[Hypothesis]:
    processors = config.processors(len(prefix or []))
    return beam_search(verifier, source_ids, settings(config), config.max_new_tokens, stats, prefix=prefix,
                       processors=processors)


def settings(config: DecodingConfig) -> BeamSettings:
    """The beam search a request asks for."""
    return BeamSettings(
        width=config.num_beams, length_penalty=config.length_penalty, early_stopping=config.early_stopping,
        n_best=config.num_return_sequences, delta=config.beam_delta,
        max_candidates=config.beam_max_candidates,
    )


SPEC = ModeSpec(
    Mode.BEAM, wire="MODE_AR_BEAM", lossless=False, drafter=DrafterMethod.NONE, run=run, title="beam search",
    verifier_sessions=one_session,  # every live hypothesis is a row of one multi-row session
    params=frozenset({"num_beams", "beam_delta", "beam_max_candidates", "length_penalty", "early_stopping",
                      "num_return_sequences"}),
)
