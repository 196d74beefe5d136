"""Input-guided aggressive decoding: drafts copied from the source, accepted up to the first mismatch."""

from __future__ import annotations

from core.interfaces import Draft
from gateway.decoding_config import Mode
from gateway.modes.mode_spec import DrafterMethod, ModeSpec, PolicyInputs
from gateway.policies.accept import exact
from gateway.policies.adaptive import maybe_adaptive
from gateway.policies.iad import CopyDrafter
from gateway.policies.loop import Accept, Propose


def build(inputs: PolicyInputs) -> tuple[Propose, Accept]:
    v = inputs.verifier
    copier = CopyDrafter(inputs.source_ids, v.bos_id, v.eos_id, cap=inputs.config.k)

    def copy(output: list[int], room: int, k: int) -> Draft:
        return copier.propose(output, min(k, room))

    return maybe_adaptive(inputs.config, inputs.load, copy, exact)


SPEC = ModeSpec(
    Mode.IAD, wire="MODE_IAD", lossless=True, drafter=DrafterMethod.NONE, build=build,
    params=frozenset({"k", "adaptive"}),
)
