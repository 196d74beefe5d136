"""Logit warping (temperature, top-k, top-p) and sampling, shared by drafter and accept loop.

Speculative sampling is only distribution-preserving when p and q are warped by the *same*
function, so both sides import this one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from core.errors import invalid

# Temperatures below this sample the argmax, as 0 does: dividing log-probs by a subnormal number
# overflows them to -inf, and exp(-inf - -inf) is NaN (ARCHITECTURE.md, "The accept rules").
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # below MIN_TEMPERATURE (0 included) means argmax
    top_k: int = 0  # 0 means off
    top_p: float = 1.0  # 1 means off


def check_sampling(params: SamplingParams, vocab_size: int | None = None) -> None:
    """INVALID_ARGUMENT for parameters `warp` cannot honour; every edge that takes them calls this.
    With `vocab_size`, top_k is bounded by it too (a larger one is a client's mistake, not "off")."""
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise invalid(f"temperature must be a finite number >= 0, got {params.temperature}")
    if params.top_k < 0:
        raise invalid(f"top_k must be >= 0 (0 = off), got {params.top_k}")
    if vocab_size is not None and params.top_k > vocab_size:
        raise invalid(f"top_k must be in [0, {vocab_size}] (0 = off), got {params.top_k}")
    if not (0 < params.top_p <= 1):
        raise invalid(f"top_p must be in (0, 1], got {params.top_p}")


def warp(logprobs: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities (float64, summing to 1) after temperature, then top-k, then top-p.

    A temperature below MIN_TEMPERATURE is argmax. Otherwise the maximum is subtracted *before*
    dividing, so the best token's term is exactly exp(0) = 1 and the others lie in [0, 1] (an
    overflow only makes one -inf, which is 0): the sum is finite and >= 1, never NaN."""
    lp = np.asarray(logprobs, dtype=np.float64)
    if params.temperature < MIN_TEMPERATURE:
        probs = np.zeros_like(lp)
        probs[int(np.argmax(lp))] = 1.0
        return probs
    with np.errstate(over="ignore"):  # a huge gap over a small temperature is -inf: probability 0
        probs = np.exp((lp - np.max(lp)) / params.temperature)
    if 0 < params.top_k < probs.size:
        order = np.argsort(-probs, kind="stable")
        probs[order[params.top_k :]] = 0.0
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = int(np.searchsorted(cum, params.top_p * cum[-1])) + 1
        probs[order[keep:]] = 0.0
    return probs / probs.sum()


def sample_index(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw; a zero-probability index can never be returned."""
    cum = np.cumsum(probs)
    idx = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    if idx >= probs.size:  # u * total rounded up to total: take the last token that can occur
        idx = int(np.flatnonzero(probs)[-1])
    return idx
