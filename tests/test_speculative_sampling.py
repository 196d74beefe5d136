"""Speculative sampling preserves the verifier's (warped) distribution.

A bigram verifier p and a different bigram drafter q over a vocabulary of 8 run through the real
policy (`decode`, mode spec); the first two output tokens over 20k draws from one RNG stream are
chi-square tested against sampling from p alone, under temperature, top-k and top-p warping.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from core.interfaces import Draft, VerifyResult
from core.sampling import SamplingParams, sample_index, warp
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.policies.accept import accept_speculative

V = 8
START = 0  # the bigram context before the first output token
DRAWS = 20_000


class BigramVerifier:
    """A verifier whose next-token distribution depends only on the previous token."""

    vocab_size = source_vocab_size = V
    bos_id = START
    eos_id = -1  # never produced: max_new_tokens ends every output
    max_source_len = 16
    max_target_len = 16

    def __init__(self, table: np.ndarray) -> None:
        self.logp = np.log(table)

    def open(self, source_ids):
        return _BigramVerifierSession(self.logp)


class _BigramVerifierSession:
    def __init__(self, logp):
        self.logp = logp
        self.seen: list[int] = []

    def step(self, committed_len, append_ids, draft_ids, top_k):
        assert 0 <= committed_len <= len(self.seen)
        self.seen = [*self.seen[:committed_len], *append_ids]
        context = [START, *self.seen]
        rows = [self.logp[context[-1]]] + [self.logp[d] for d in draft_ids]
        self.seen += draft_ids
        order = [np.argsort(-r, kind="stable")[:top_k] for r in rows]
        return VerifyResult(
            top1=[int(o[0]) for o in order],
            topk_ids=[o.tolist() for o in order],
            topk_logprobs=[r[o].tolist() for r, o in zip(rows, order, strict=True)],
            draft_logprobs=[float(rows[i][d]) for i, d in enumerate(draft_ids)],
        )

    def close(self):
        pass


class BigramDrafter:
    vocab_size = V

    def __init__(self, table: np.ndarray, rng: np.random.Generator) -> None:
        self.logq = np.log(table)
        self.rng = rng  # one stream for every draw of the test: never reseeded per draw

    def open(self, source_ids, seed=0):
        return _BigramDrafterSession(self.logq, self.rng)


class _BigramDrafterSession:
    def __init__(self, logq, rng):
        self.logq, self.rng = logq, rng
        self.seen: list[int] = []

    def draft_sample(self, committed_len, append_ids, gamma, params):
        self.seen = [*self.seen[:committed_len], *append_ids]
        last = ([START, *self.seen])[-1]
        ids, rows = [], []
        for _ in range(gamma):
            q = warp(self.logq[last], params)
            last = sample_index(q, self.rng)
            ids.append(last)
            support = np.flatnonzero(q)
            rows.append((support.tolist(), q[support].tolist()))
        return Draft(ids=ids, q_rows=rows)

    def close(self):
        pass


def _tables(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(V, 0.7), size=V)
    q = rng.dirichlet(np.full(V, 0.7), size=V)
    return p, q


def _expected_pairs(p: np.ndarray, params: SamplingParams) -> np.ndarray:
    logp = np.log(p)
    first = warp(logp[START], params)
    return np.array([[first[a] * warp(logp[a], params)[b] for b in range(V)] for a in range(V)])


def _sample_pairs(p, q, params, gamma, seed, draws=DRAWS) -> np.ndarray:
    rng = np.random.default_rng(seed)
    verifier, drafter = BigramVerifier(p), BigramDrafter(q, rng)
    config = DecodingConfig(
        mode=Mode.SPECULATIVE, gamma=gamma, max_new_tokens=2,
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
    )
    counts = np.zeros((V, V))
    for _ in range(draws):
        out = decode([1, 2, 3], config, verifier, drafter, rng=rng).output_ids
        counts[out[0], out[1]] += 1
    return counts


def _chi_square_p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    observed, probs = counts.ravel(), expected_probs.ravel()
    if observed[probs == 0].sum() > 0:
        return 0.0  # an impossible pair was produced
    keep = probs > 0
    expected = probs[keep] * observed.sum()
    stat = float(((observed[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    # Survival function of chi-square(dof) = regularised upper incomplete gamma.
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


# The default run checks the plain warp and the one combining all three; the others run in .ci/run's slow step.
_SLOW = pytest.mark.slow
WARPS = [
    SamplingParams(),
    pytest.param(SamplingParams(temperature=0.6), marks=_SLOW),
    pytest.param(SamplingParams(temperature=1.5, top_k=3), marks=_SLOW),
    pytest.param(SamplingParams(top_p=0.7), marks=_SLOW),
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
]


@pytest.mark.parametrize("params", WARPS, ids=lambda w: f"T{w.temperature}-k{w.top_k}-p{w.top_p}")
def test_first_two_tokens_follow_the_verifier_distribution(params):
    p, q = _tables(seed=7)
    counts = _sample_pairs(p, q, params, gamma=3, seed=11)
    assert _chi_square_p_value(counts, _expected_pairs(p, params)) > 1e-3


def test_the_chi_square_check_rejects_the_drafters_distribution():
    """The test has power: samples from q alone fail the same check against p."""
    p, q = _tables(seed=7)
    params = SamplingParams()
    rng = np.random.default_rng(3)
    pairs = np.zeros((V, V))
    for _ in range(DRAWS):
        a = sample_index(warp(np.log(q[START]), params), rng)
        b = sample_index(warp(np.log(q[a]), params), rng)
        pairs[a, b] += 1
    assert _chi_square_p_value(pairs, _expected_pairs(p, params)) < 1e-6


def test_p_equal_q_accepts_everything_without_nan():
    p, _ = _tables(seed=5)
    rng = np.random.default_rng(0)
    verifier, drafter = BigramVerifier(p), BigramDrafter(p, rng)
    config = DecodingConfig(mode=Mode.SPECULATIVE, gamma=4, max_new_tokens=15)
    result = decode([1], config, verifier, drafter, rng=rng)
    assert len(result.output_ids) == 15
    # With p == q every draft token is accepted: 4 drafted + 1 bonus per iteration.
    assert result.stats.accepted_tokens == result.stats.drafted_tokens


def test_one_hot_distributions_produce_no_nan():
    vocab = 4
    one_hot = np.full(vocab, -np.inf)
    one_hot[2] = 0.0
    res = VerifyResult(
        top1=[2, 2], topk_ids=[[2, 0, 1, 3]] * 2, topk_logprobs=[one_hot[[2, 0, 1, 3]].tolist()] * 2,
        draft_logprobs=[float(one_hot[1])],
    )
    rng = np.random.default_rng(0)
    # q is one-hot on 1, p one-hot on 2: the draft must be rejected and 2 drawn from the residual.
    for params in (SamplingParams(), SamplingParams(temperature=0.5, top_k=2, top_p=0.5)):
        a, token = accept_speculative([1], [([1], [1.0])], res, params, vocab, rng)
        assert (a, token) == (0, 2)
    # q == p one-hot: accepted, then the bonus token from p.
    assert accept_speculative([2], [([2], [1.0])], res, SamplingParams(), vocab, rng) == (1, 2)


def test_temperature_zero_is_greedy():
    p, q = _tables(seed=9)
    rng = np.random.default_rng(0)
    verifier, drafter = BigramVerifier(p), BigramDrafter(q, rng)
    out = decode([1], DecodingConfig(mode=Mode.SPECULATIVE, temperature=0.0, max_new_tokens=6),
                 verifier, drafter, rng=rng).output_ids
    expected, last = [], START
    for _ in range(6):
        last = int(np.argmax(p[last]))
        expected.append(last)
    assert out == expected


def test_warp_keeps_exactly_the_top_k_and_the_top_p_nucleus():
    logp = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))
    assert np.flatnonzero(warp(logp, SamplingParams(top_k=2))).tolist() == [1, 3]
    # 0.4 + 0.3 = 0.7 < 0.75, so the nucleus needs 0.15 as well.
    assert np.flatnonzero(warp(logp, SamplingParams(top_p=0.75))).tolist() == [1, 3, 4]
    for combo in itertools.product([0.5, 1.0, 2.0], [0, 1, 3], [0.3, 1.0]):
        probs = warp(logp, SamplingParams(*combo))
        assert np.isclose(probs.sum(), 1.0) and not np.isnan(probs).any()
