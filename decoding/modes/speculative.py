"""Speculative sampling: the AR drafter samples gamma tokens, each kept with probability min(1, p/q);
the output is distributed exactly as sampling from the verifier."""

from __future__ import annotations

from functools import partial

from core.interfaces import Draft, VerifyResult
from decoding.config import DecodingConfig, Mode
from decoding.modes.mode_spec import DrafterMethod, ModeSpec, PolicyInputs
from decoding.policies.accept import accept_speculative
from decoding.policies.loop import Accept, Propose


def build(inputs: PolicyInputs) -> tuple[Propose, Accept]:
    assert inputs.drafter is not None
    params = inputs.config.sampling
    vocab_size = inputs.verifier.vocab_size
    rng = inputs.rng

    def accept(ids: list[int], draft: Draft, res: VerifyResult) -> tuple[int, int]:
        return accept_speculative(ids, draft.q_rows, res, params, vocab_size, rng)

    return partial(inputs.drafter.sample, gamma=inputs.config.gamma, params=params), accept


def whole_vocabulary(config: DecodingConfig, vocab_size: int) -> int:
    return vocab_size  # the residual max(0, p - q) needs p over the whole vocabulary


SPEC = ModeSpec(
    Mode.SPECULATIVE, wire="MODE_SPECULATIVE_SAMPLING", lossless=False, drafter=DrafterMethod.SAMPLE, build=build,
    top_k=whole_vocabulary, params=frozenset({"gamma", "temperature", "top_k", "top_p"}),
)
