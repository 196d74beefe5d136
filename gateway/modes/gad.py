"""Generalized aggressive decoding: the NAR drafter drafts k tokens, accepted up to the first mismatch
(with `adaptive`, up to k tokens per step as the load makes worthwhile)."""

from __future__ import annotations

from gateway.decoding_config import Mode
from gateway.modes.mode_spec import DrafterMethod, ModeSpec, PolicyInputs
from gateway.policies.accept import exact, first_exact
from gateway.policies.adaptive import maybe_adaptive
from gateway.policies.loop import Accept, Propose


def build(inputs: PolicyInputs) -> tuple[Propose, Accept]:
    assert inputs.drafter is not None
    return maybe_adaptive(inputs.config, inputs.load, inputs.drafter.block, exact)


SPEC = ModeSpec(Mode.GAD, wire="MODE_GAD", lossless=True, drafter=DrafterMethod.BLOCK, build=build, overlap=True,
                preverify=lambda config: first_exact, realign=True, lookahead=True,
                params=frozenset({"k", "adaptive"}))
