"""GAD++: GAD's drafts, accepted while in the verifier's top-beta and within tau of its top-1."""

from __future__ import annotations

from functools import partial

from core.interfaces import Draft, VerifyResult
from decoding.config import DecodingConfig, Mode
from decoding.modes.mode_spec import DrafterMethod, ModeSpec, PolicyInputs
from decoding.policies.accept import accept_gad_plus_plus, first_gad_plus_plus
from decoding.policies.adaptive import maybe_adaptive
from decoding.policies.loop import Accept, Propose


def build(inputs: PolicyInputs) -> tuple[Propose, Accept]:
    assert inputs.drafter is not None
    config = inputs.config

    def accept(ids: list[int], draft: Draft, res: VerifyResult) -> tuple[int, int]:
        return accept_gad_plus_plus(ids, res, config.beta, config.tau)

    return maybe_adaptive(config, inputs.load, inputs.drafter.block, accept)


def first_rule(config: DecodingConfig):
    return partial(first_gad_plus_plus, beta=config.beta, tau=config.tau)


def top_beta(config: DecodingConfig, vocab_size: int) -> int:
    return config.beta  # the accept rule looks a draft token up among the top-beta


SPEC = ModeSpec(
    Mode.GAD_PLUS_PLUS, wire="MODE_GAD_PLUS_PLUS", lossless=False, drafter=DrafterMethod.BLOCK, build=build,
    top_k=top_beta, overlap=True, preverify=first_rule, params=frozenset({"k", "beta", "tau", "adaptive"}),
)
