"""Input-guided aggressive decoding: drafts copied from the source, accepted up to the first mismatch."""

from __future__ import annotations

from core.copy_draft import CopyDrafter
from core.interfaces import Draft
from decoding.config import Mode
from decoding.modes.mode_spec import DrafterMethod, ModeSpec, PolicyInputs
from decoding.policies.accept import exact
from decoding.policies.adaptive import maybe_adaptive
from decoding.policies.loop import Accept, Propose


def build(inputs: PolicyInputs) -> tuple[Propose, Accept]:
    v = inputs.verifier
    copier = CopyDrafter(inputs.source_ids, v.bos_id, v.eos_id, cap=inputs.config.k)

    def copy(output: list[int], room: int, k: int) -> Draft:
        return copier.propose(output, min(k, room))

    return maybe_adaptive(inputs.config, inputs.load, copy, exact)


SPEC = ModeSpec(
    Mode.IAD, wire="MODE_IAD", lossless=True, drafter=DrafterMethod.NONE, build=build, copy_runs=True,
    params=frozenset({"k", "adaptive"}),
)
