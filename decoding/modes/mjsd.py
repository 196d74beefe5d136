"""Multi-token joint speculative decoding: the AR drafter beam-searches gamma tokens; the longest
prefix whose joint likelihood ratio passes the threshold is accepted."""

from __future__ import annotations

from functools import partial

from core.interfaces import Draft, VerifyResult
from decoding.config import Mode
from decoding.modes.mode_spec import DrafterMethod, ModeSpec, PolicyInputs
from decoding.policies.accept import accept_mjsd
from decoding.policies.loop import Accept, Propose


def build(inputs: PolicyInputs) -> tuple[Propose, Accept]:
    assert inputs.drafter is not None
    config = inputs.config

    def accept(ids: list[int], draft: Draft, res: VerifyResult) -> tuple[int, int]:
        return accept_mjsd(ids, draft.cum_logq, res, config.threshold)

    return partial(inputs.drafter.beam, gamma=config.gamma, num_beams=config.num_beams), accept


SPEC = ModeSpec(
    Mode.MJSD, wire="MODE_MJSD", lossless=False, drafter=DrafterMethod.BEAM, build=build, overlap=True,
    params=frozenset({"gamma", "num_beams", "threshold"}),
)
