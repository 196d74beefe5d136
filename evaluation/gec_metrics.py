"""Scores for grammatical error correction output: GLEU and exact match against several references.

GLEU is the GEC metric of Napoles, Sakaguchi, Post and Tetreault, "Ground Truth for Grammatical
Error Correction Metrics" (ACL 2015), in its revised form from "GLEU Without Tuning"
(arXiv:1605.02592, 2016), as implemented by the authors' reference scorer `compute_gleu`
(github.com/cnap/gec-ranking). It is BLEU with one change: an n-gram of the hypothesis that also
occurs in the *source* but in none of the reference's n-grams (i.e. it should have been changed
and was not) is subtracted from the matches. Per sentence and order n = 1..4:

    matches_n = |H_n ∩ R_n| - |H_n ∩ (S_n \\ R_n)|     (clipped counts; floored at 0)
    total_n   = max(len(h) - n + 1, 0)

summed over the corpus; the score is `BP * exp(mean_n log(matches_n / total_n))` with
`BP = exp(min(0, 1 - r / c))` (c, r = hypothesis and reference token totals), and 0 when any
summed statistic is 0 (the reference scorer does not smooth corpus scores). With several
references per sentence the reference scorer draws one reference per sentence at random, scores
the corpus, and averages over many draws; `gleu` does the same with a seeded generator.

Tokenisation: UA-GEC text is not pre-tokenised, so words and punctuation marks are split apart
(`\\w+` runs and single non-space symbols) before counting n-grams; scores are reported x100.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

ORDER = 4
DEFAULT_DRAWS = 500  # the reference scorer's default number of iterations
_TOKEN = re.compile(r"\w+|[^\w\s]")


def gleu(
    sources: Sequence[str],
    hypotheses: Sequence[str],
    references: Sequence[Sequence[str]],
    draws: int = DEFAULT_DRAWS,
    seed: int = 0,
) -> float:
    """Corpus GLEU (0..100) of `hypotheses` for `sources` against one or more references each."""
    if not (len(sources) == len(hypotheses) == len(references)):
        raise ValueError("sources, hypotheses and references must have the same length")
    if not sources:
        raise ValueError("GLEU needs at least one sentence")
    if any(not refs for refs in references):
        raise ValueError("every sentence needs at least one reference")
    # stats[i][j] = the statistics of sentence i against its reference j.
    stats = [
        [sentence_stats(tokenize(s), tokenize(h), tokenize(r)) for r in refs]
        for s, h, refs in zip(sources, hypotheses, references, strict=True)
    ]
    if all(len(per_ref) == 1 for per_ref in stats):
        return 100.0 * gleu_from_stats(np.sum([per_ref[0] for per_ref in stats], axis=0))
    rng = np.random.default_rng(seed)
    counts = np.array([len(per_ref) for per_ref in stats])
    width = 2 + 2 * ORDER
    table = np.zeros((len(stats), counts.max(), width))
    for i, per_ref in enumerate(stats):
        table[i, : len(per_ref)] = per_ref
    rows = np.arange(len(stats))
    scores = []
    for _ in range(draws):
        picks = rng.integers(0, counts)  # one reference per sentence, uniformly among its own
        scores.append(gleu_from_stats(table[rows, picks].sum(axis=0)))
    return 100.0 * float(np.mean(scores))


def exact_match(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """% of hypotheses identical (after whitespace normalisation) to at least one of their references."""
    if not hypotheses:
        return 0.0
    hits = sum(_norm(h) in {_norm(r) for r in refs} for h, refs in zip(hypotheses, references, strict=True))
    return 100.0 * hits / len(hypotheses)


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


def sentence_stats(source: list[str], hypothesis: list[str], reference: list[str]) -> np.ndarray:
    """[c, r, matches_1, total_1, ..., matches_4, total_4] for one sentence and one reference."""
    out = [len(hypothesis), len(reference)]
    for n in range(1, ORDER + 1):
        h, r, s = _ngrams(hypothesis, n), _ngrams(reference, n), _ngrams(source, n)
        # Source n-grams absent from the reference: keeping them means a missed correction.
        s_not_r = Counter({g: c for g, c in s.items() if g not in r})
        matches = sum((h & r).values()) - sum((h & s_not_r).values())
        out += [max(matches, 0), max(len(hypothesis) - n + 1, 0)]
    return np.array(out, dtype=np.float64)


def gleu_from_stats(stats: np.ndarray) -> float:
    """GLEU (0..1) from summed `sentence_stats`."""
    if np.any(stats == 0):
        return 0.0
    c, r = stats[0], stats[1]
    log_precision = np.mean(np.log(stats[2::2] / stats[3::2]))
    return float(np.exp(min(0.0, 1.0 - r / c) + log_precision))


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _norm(text: str) -> str:
    return " ".join(text.split())
