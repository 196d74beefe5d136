"""Per-request decoding parameters, their defaults and their bounds."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

from core.errors import invalid, out_of_range
from core.sampling import SamplingParams, check_sampling


class Mode(StrEnum):
    AR = "ar"
    BEAM = "beam"
    IAD = "iad"
    GAD = "gad"
    GAD_PLUS_PLUS = "gad++"
    MJSD = "mjsd"
    SPECULATIVE = "spec"


# Modes whose output is, by construction, exactly the verifier's greedy output.
LOSSLESS_MODES = frozenset({Mode.AR, Mode.IAD, Mode.GAD})
DRAFTER_MODES = frozenset({Mode.GAD, Mode.GAD_PLUS_PLUS, Mode.MJSD, Mode.SPECULATIVE})


@dataclass(frozen=True)
class DecodingConfig:
    mode: Mode = Mode.GAD
    k: int = 10  # GAD block size; IAD copy cap
    beta: int = 3  # GAD++ top-beta
    tau: float = 1.0  # GAD++ log-prob gap
    num_beams: int = 4  # AR beam width; MJSD drafter beams
    gamma: int = 4  # MJSD / speculative sampling draft length
    threshold: float = 0.1  # MJSD joint likelihood-ratio threshold
    beam_delta: float | None = None  # variable-width beam: absolute score threshold
    beam_max_candidates: int | None = None  # variable-width beam: candidates per parent
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def with_overrides(self, overrides: dict[str, Any]) -> DecodingConfig:
        """A copy with the given fields replaced (None values are ignored)."""
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise invalid(f"unknown decoding parameters: {sorted(unknown)}")
        given = {k: v for k, v in overrides.items() if v is not None}
        if "mode" in given:
            given["mode"] = parse_mode(given["mode"])
        return replace(self, **given)


@dataclass(frozen=True)
class DecodingLimits:
    max_k: int = 64
    max_beta: int = 64
    max_beams: int = 16
    max_gamma: int = 32
    max_new_tokens: int = 256


def parse_mode(value: str | Mode) -> Mode:
    try:
        return Mode(value)
    except ValueError:
        choices = ", ".join(m.value for m in Mode)
        raise invalid(f"unknown mode {value!r}; choose one of {choices}") from None


def validate(cfg: DecodingConfig, limits: DecodingLimits, max_target_len: int) -> None:
    """Raise INVALID_ARGUMENT for malformed values, OUT_OF_RANGE for values over a limit."""
    _bounded("k", cfg.k, 1, limits.max_k)
    _bounded("beta", cfg.beta, 1, limits.max_beta)
    _bounded("num_beams", cfg.num_beams, 1, limits.max_beams)
    _bounded("gamma", cfg.gamma, 1, limits.max_gamma)
    _bounded("max_new_tokens", cfg.max_new_tokens, 1, min(limits.max_new_tokens, max_target_len))
    if not (math.isfinite(cfg.tau) and cfg.tau >= 0):
        raise invalid(f"tau must be a finite number >= 0, got {cfg.tau}")
    if not (0 < cfg.threshold <= 1):
        raise invalid(f"threshold must be in (0, 1], got {cfg.threshold}")
    if cfg.beam_delta is not None and not cfg.beam_delta >= 0:
        raise invalid(f"beam_delta must be >= 0, got {cfg.beam_delta}")
    if cfg.beam_max_candidates is not None and cfg.beam_max_candidates < 1:
        raise invalid(f"beam_max_candidates must be >= 1, got {cfg.beam_max_candidates}")
    check_sampling(cfg.sampling)
    if cfg.seed < 0:
        raise invalid(f"seed must be >= 0, got {cfg.seed}")


def _bounded(name: str, value: int, low: int, high: int) -> None:
    if value < low:
        raise invalid(f"{name} must be >= {low}, got {value}")
    if value > high:
        raise out_of_range(f"{name} must be <= {high}, got {value}")
