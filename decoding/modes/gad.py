"""Generalized aggressive decoding: the NAR drafter drafts k tokens, accepted up to the first mismatch
(with `adaptive`, up to k tokens per step as the load makes worthwhile)."""

from __future__ import annotations

from decoding.config import Mode
from decoding.modes.mode_spec import DrafterMethod, ModeSpec, PolicyInputs
from decoding.policies.accept import exact, first_exact
from decoding.policies.adaptive import maybe_adaptive
from decoding.policies.loop import Accept, Propose


def build(inputs: PolicyInputs) -> tuple[Propose, Accept]:
    assert inputs.drafter is not None
    return maybe_adaptive(inputs.config, inputs.load, inputs.drafter.block, exact)


SPEC = ModeSpec(Mode.GAD, wire="MODE_GAD", lossless=True, drafter=DrafterMethod.BLOCK, build=build, overlap=True,
                preverify=lambda config: first_exact, realign=True, lookahead=True,
                params=frozenset({"k", "adaptive"}))
