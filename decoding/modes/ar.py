"""AR greedy: the draft-verify loop with an empty draft; the reference every lossless mode matches."""

from __future__ import annotations

from core.interfaces import Draft
from decoding.config import Mode
from decoding.modes.mode_spec import DrafterMethod, ModeSpec, PolicyInputs
from decoding.policies.accept import exact
from decoding.policies.loop import Accept, Propose


def build(inputs: PolicyInputs) -> tuple[Propose, Accept]:
    return no_draft, exact


def no_draft(output: list[int], room: int) -> Draft:
    return Draft(ids=[])


SPEC = ModeSpec(
    Mode.AR, wire="MODE_AR_GREEDY", lossless=True, drafter=DrafterMethod.NONE, build=build, greedy=True
)
