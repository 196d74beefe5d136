"""The mode registry: every decoding mode, declared once by a `ModeSpec` in its own module here.

`decoding.decode.decode()`, the wire maps (gateway.wire), the gateway's fallback and the CLI's --mode choices all
read `MODES`; nothing else lists the modes.

Adding a mode:
1. Add its value to the `Mode` enum in decoding/config.py, and a `MODE_<NAME>` value to
   the `Mode` enum in protos/specdec/v1/gateway.proto (stubs regenerate on import, or
   `python -m protos.build`).
2. Write decoding/modes/<name>.py declaring `SPEC = ModeSpec(Mode.X, wire="MODE_<NAME>", lossless=...,
   drafter=DrafterMethod.NONE | BLOCK | BEAM | SAMPLE, build=..., top_k=...)`: `build(inputs)` returns
   (propose, accept) for the draft-verify loop; a mode outside that loop gives `run=` instead.
3. Put its accept rule, if new, in decoding/policies/accept.py, as a pure function with a test.
4. Add `<name>.SPEC` to `_SPECS` below. New decoding parameters are DecodingConfig fields (with
   `field(default=..., metadata=about(help, flag=..., wire=...))`) and gateway.proto fields; the
   CLI flags and wire maps follow from them.
5. tests/test_mode_registry.py checks that every Mode and wire value has a spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from core.errors import invalid
from decoding.config import DecodingConfig, Mode, cli_flag
from decoding.modes import ar, beam, gad, gad_plus_plus, iad, mjsd, speculative
from decoding.modes.mode_spec import COMMON_PARAMS, PROCESSOR_PARAMS, DrafterMethod, ModeSpec, PolicyInputs

_SPECS = (ar.SPEC, beam.SPEC, iad.SPEC, gad.SPEC, gad_plus_plus.SPEC, mjsd.SPEC, speculative.SPEC)

MODES: dict[Mode, ModeSpec] = {spec.mode: spec for spec in _SPECS}
# Modes whose output is, by construction, exactly the verifier's greedy output.
LOSSLESS_MODES = frozenset(mode for mode, spec in MODES.items() if spec.lossless)
# Modes that need the drafter service (the gateway falls back to AR without it).
DRAFTER_MODES = frozenset(mode for mode, spec in MODES.items() if spec.needs_drafter)

__all__ = [
    "DRAFTER_MODES", "LOSSLESS_MODES", "MODES", "DrafterMethod", "ModeSpec", "PolicyInputs", "check_applicable",
    "mode_names",
]


def check_applicable(overrides: Mapping[str, Any], mode: Mode, flags: bool = False) -> None:
    """INVALID_ARGUMENT when a request sets a decoding parameter that `mode` does not read (a silently
    ignored --beta with --mode gad would look as if it had been used). `flags`: name them as CLI flags."""
    spec = MODES[mode]
    extra = sorted(name for name, value in overrides.items() if value is not None and name not in spec.applicable)
    if not extra:
        return
    names = {f.name: cli_flag(f) if flags else f.name for f in fields(DecodingConfig)}
    unknown = [name for name in extra if name not in names]
    if unknown:
        raise invalid(f"unknown decoding parameter{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                      f"(the parameters: {', '.join(sorted(names.values()))})")
    own = ", ".join(names[t] for t in sorted(spec.applicable - COMMON_PARAMS))
    common = ", ".join(names[c] for c in sorted(COMMON_PARAMS - {"mode"} - PROCESSOR_PARAMS))
    common += " and the logits processors"
    takes = f"{own}, {common}" if own else f"only {common}"
    verb = "does" if len(extra) == 1 else "do"
    raise invalid(f"{', '.join(names[e] for e in extra)} {verb} not apply to mode {mode.value} (it takes {takes})")


def mode_names() -> list[str]:
    """The modes' names as users type them (--mode, [defaults] mode), in declaration order."""
    return [mode.value for mode in MODES]
