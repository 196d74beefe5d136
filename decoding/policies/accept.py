"""The accept rules of ARCHITECTURE.md, "The accept rules", as pure functions of a draft and the verifier's answer.

Each returns `(a, token)`: accept the first `a` drafted tokens, then append `token`.
"""

from __future__ import annotations

import math

import numpy as np

from core.interfaces import Draft, VerifyResult
from core.sampling import SamplingParams, sample_index, warp


def accept_exact(draft: list[int], res: VerifyResult) -> tuple[int, int]:
    """IAD / GAD / AR greedy: accept up to the first mismatch with the verifier's top-1."""
    a = 0
    while a < len(draft) and draft[a] == res.top1[a]:
        a += 1
    return a, res.top1[a]


def exact(ids: list[int], draft: Draft, res: VerifyResult) -> tuple[int, int]:
    """`accept_exact` in the loop's Accept shape (AR greedy, IAD, GAD)."""
    return accept_exact(ids, res)


def first_exact(token: int, res: VerifyResult) -> bool:
    """GAD's rule at one position (pre-verify): the draft token is the verifier's top-1 there."""
    return token == res.top1[0]


def first_gad_plus_plus(token: int, res: VerifyResult, beta: int, tau: float) -> bool:
    """GAD++'s rule at one position (pre-verify), from a step that scored no draft: the token's
    log-prob is read off the verifier's top-k (which holds the top-beta), where it must be anyway."""
    top_ids = list(res.topk_ids[0][:beta])
    if token not in top_ids:
        return False
    return res.topk_logprobs[0][0] - res.topk_logprobs[0][top_ids.index(token)] <= tau


def accept_gad_plus_plus(draft: list[int], res: VerifyResult, beta: int, tau: float) -> tuple[int, int]:
    """d_i passes when it is in the top-beta and log p(v_i) - log p(d_i) <= tau."""
    a = 0
    while a < len(draft):
        in_top = draft[a] in res.topk_ids[a][:beta]
        if not (in_top and res.topk_logprobs[a][0] - res.draft_logprobs[a] <= tau):
            break
        a += 1
    return a, res.top1[a]


def accept_mjsd(draft: list[int], cum_logq: list[float], res: VerifyResult, threshold: float) -> tuple[int, int]:
    """Longest prefix i with min(0, P_i - Q_i) > log(threshold), then the verifier's argmax."""
    log_threshold = math.log(threshold)
    eta = 0
    p_cum = 0.0
    for i in range(len(draft)):
        p_cum += res.draft_logprobs[i]
        if min(0.0, p_cum - cum_logq[i]) > log_threshold:
            eta = i + 1
    return eta, res.top1[eta]


def accept_speculative(
    draft: list[int],
    q_rows: list[tuple[list[int], list[float]]],
    res: VerifyResult,
    params: SamplingParams,
    vocab_size: int,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Leviathan/Chen: accept d_i w.p. min(1, p/q); on rejection draw from norm(max(0, p - q))."""
    for i, token in enumerate(draft):
        p = warp(_dense_logprobs(res.topk_ids[i], res.topk_logprobs[i], vocab_size), params)
        q = np.zeros(vocab_size)
        q[q_rows[i][0]] = q_rows[i][1]
        # r < p/q written without the division, so q == 0 (impossible for a drawn token) cannot NaN.
        if rng.random() * q[token] < p[token]:
            continue
        residual = np.maximum(p - q, 0.0)
        if residual.sum() <= 0.0:  # p <= q everywhere means p == q: rejection had probability 0
            residual = p
        return i, sample_index(residual / residual.sum(), rng)
    n = len(draft)
    p = warp(_dense_logprobs(res.topk_ids[n], res.topk_logprobs[n], vocab_size), params)
    return n, sample_index(p, rng)


def _dense_logprobs(ids: list[int], logprobs: list[float], vocab_size: int) -> np.ndarray:
    dense = np.full(vocab_size, -np.inf)
    dense[ids] = logprobs
    return dense
