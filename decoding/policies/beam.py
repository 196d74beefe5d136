"""AR beam search through the `Verifier` interface: the search of `transformers`'
`generate(num_beams=N)`, step for step.

Each step keeps the 2N best continuations of all running hypotheses (by the sum of their tokens'
log-probs); of those, the ones ending in EOS or reaching the length limit and ranked among the
first N are offered to the finished set (its N best, each scored by its sum over its length **
`length_penalty`, the EOS counted), and the N best others run on. `early_stopping` says when the
search ends: `true` once N hypotheses are finished; `false` once the best running hypothesis,
scored at its present length, cannot beat the worst finished one; `never` likewise, but scored at
the length limit when `length_penalty` > 0 (the bound that holds). Width 1 is greedy search, as
`generate`'s. specdec's earlier search (each finished hypothesis took one of the N places; it ended
when N were finished) is not kept: where the two differ, `generate`'s finds the better-scoring output.

Each step's candidates may be pruned (variable width, Freitag & Al-Onaizan 2017): only those within
`delta` of the best one, and at most `max_candidates` per parent.

All running hypotheses are the rows of ONE multi-row verifier session (`core.interfaces.MultiRowSession`):
each iteration is one `step_rows` call that forks every surviving child from its parent's row
(`BeamRow(parent, len(parent), [token])`) and scores the next token of every row in one forward.
Finished hypotheses are not continued, so their rows leave the batch. A verifier whose sessions
have a single row gets the same `step_rows` from `core.multirow.RowsOverSessions` (one session per
row), so the same code runs in-process, over gRPC and on either kind of backend.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from core.interfaces import BeamRow, Verifier
from core.logits_processors import Processors
from core.multirow import open_rows
from decoding.config import EarlyStopping
from decoding.policies.loop import DecodeStats, Hypothesis


@dataclass(frozen=True)
class BeamSettings:
    """What one beam search runs with (DecodingConfig's beam fields)."""

    width: int
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = EarlyStopping.FALSE
    n_best: int = 1  # hypotheses returned, best first (num_return_sequences)
    delta: float | None = None
    max_candidates: int | None = None


def beam_search(
    verifier: Verifier,
    source_ids: list[int],
    settings: BeamSettings,
    max_new_tokens: int,
    stats: DecodeStats,
    native_rows: bool = True,
    prefix: list[int] | None = None,
    processors: Processors | None = None,
) -> list[Hypothesis]:
    """The `settings.n_best` best finished hypotheses, best first. Every hypothesis starts with
    `prefix` (tokens already committed, such as a target language's forced first token: log-prob 0,
    as `generate`'s forced tokens, counted in its length and in `max_new_tokens`). `native_rows=False`
    forces the single-row-session adapter even where the verifier's sessions have `step_rows`.
    `processors`: the logits processors the verifier applies (in log-prob space but at width 1)."""
    session = open_rows(verifier, source_ids, native=native_rows, processors=processors)
    try:
        search = _Search(settings, verifier.eos_id, max_new_tokens, verifier.vocab_size, list(prefix or []))
        rows = [BeamRow(parent=0, committed_len=0, append_ids=search.alive[0].tokens)]  # the session's one row
        while rows:
            t0 = time.perf_counter()
            results = session.step_rows(rows, search.top_k)
            stats.verifier_time_s += time.perf_counter() - t0
            stats.iterations += 1
            rows = search.advance([(r.topk_ids[0], r.topk_logprobs[0]) for r in results])
        best = search.best()
        stats.output_tokens = len(best[0].output_ids)
        stats.finish_reason = best[0].finish_reason
        return best
    finally:
        session.close()


@dataclass
class _Hyp:
    tokens: list[int]
    score: float  # the sum of its tokens' log-probs
    logprobs: list[float]


@dataclass(frozen=True)
class _Candidate:
    score: float
    parent: int
    token: int
    logprob: float


class _Search:
    """The search's state between steps: the running hypotheses (`alive`, in row order) and the
    finished ones (best first)."""

    def __init__(self, settings: BeamSettings, eos: int, max_new_tokens: int, vocab: int, prefix: list[int]) -> None:
        self.s = settings
        self.eos = eos
        self.max_new = max_new_tokens
        self.alive = [_Hyp(prefix, 0.0, [0.0] * len(prefix))]
        self.finished: list[Hypothesis] = []
        # generate() keeps 2N candidates, so that N run on even when N of them end in EOS.
        per_step = 2 * settings.width
        self.top_k = min(per_step, settings.max_candidates or per_step, vocab)
        # Width 1 is greedy search (generate() runs it for num_beams=1): the first EOS ends it.
        self.greedy = settings.width == 1

    def advance(self, scored: list[tuple[list[int], list[float]]]) -> list[BeamRow]:
        """Take one step's top-k (ids, log-probs) per running row; the rows of the next step
        (none: the search is over)."""
        grown = self._step(self._candidates(scored))
        rows = [BeamRow(parent=c.parent, committed_len=len(self.alive[c.parent].tokens), append_ids=[c.token])
                for c in grown]
        if grown:  # none (the search is over): the running hypotheses stay, for best() if none finished
            self.alive = [self._child(c) for c in grown]
        return rows

    def best(self) -> list[Hypothesis]:
        """The n best finished hypotheses; none finished (every continuation banned): the best running one."""
        if not self.finished:
            hyp = self.alive[0]
            score = _normalised(hyp.score, max(len(hyp.tokens), 1), self.s.length_penalty)
            self.finished = [Hypothesis(hyp.tokens, score, hyp.logprobs, "length")]
        return self.finished[: self.s.n_best]

    def _candidates(self, scored: list[tuple[list[int], list[float]]]) -> list[_Candidate]:
        """Every row's continuations, best first (ties: the earlier row, then the better rank), pruned."""
        ranked = []
        for j, (hyp, (ids, logprobs)) in enumerate(zip(self.alive, scored, strict=True)):
            for r, (token, lp) in enumerate(zip(ids[: self.top_k], logprobs[: self.top_k], strict=True)):
                if lp > -math.inf:  # a banned token (a logits processor's -inf) never continues
                    ranked.append((hyp.score + lp, j, r, token, lp))
        ranked.sort(key=lambda c: (-c[0], c[1], c[2]))
        if self.s.delta is not None and ranked:
            floor = ranked[0][0] - self.s.delta
            ranked = [c for c in ranked if c[0] >= floor]
        return [_Candidate(score, j, token, lp) for score, j, _, token, lp in ranked]

    def _step(self, candidates: list[_Candidate]) -> list[_Candidate]:
        """generate()'s step (`_beam_search`: `_get_top_k_continuations`, `_update_finished_beams`,
        `_get_running_beams_for_next_iteration`, `_check_early_stop_heuristic`)."""
        width, early = self.s.width, self.s.early_stopping
        candidates = candidates[: 2 * width]
        length = len(self.alive[0].tokens) + 1  # every running hypothesis has the same length
        full = len(self.finished) == width
        if not (full and early == EarlyStopping.TRUE):
            done = [self._finish(c) for c in candidates[:width] if self._ends(c)]
            # Stable: on a tie, hypotheses finished earlier come first.
            self.finished = sorted(self.finished + done, key=lambda h: -h.score)[:width]
        running = [c for c in candidates if not self._ends(c)][:width]
        if not running or (self.greedy and self.finished):
            return []
        if len(self.finished) == width:
            if early == EarlyStopping.TRUE:
                return []
            bound = self.max_new if early == EarlyStopping.NEVER and self.s.length_penalty > 0 else length
            if not _normalised(running[0].score, bound, self.s.length_penalty) > self.finished[-1].score:
                return []
        return running

    def _ends(self, c: _Candidate) -> bool:
        return c.token == self.eos or len(self.alive[c.parent].tokens) + 1 >= self.max_new

    def _finish(self, c: _Candidate) -> Hypothesis:
        """A candidate that ends its hypothesis (EOS, or the length limit): scored over its length,
        its EOS counted."""
        parent = self.alive[c.parent]
        length = len(parent.tokens) + 1
        score = _normalised(c.score, length, self.s.length_penalty)
        if c.token == self.eos:
            return Hypothesis(list(parent.tokens), score, [*parent.logprobs, c.logprob], "eos")
        return Hypothesis([*parent.tokens, c.token], score, [*parent.logprobs, c.logprob], "length")

    def _child(self, c: _Candidate) -> _Hyp:
        parent = self.alive[c.parent]
        return _Hyp([*parent.tokens, c.token], c.score, [*parent.logprobs, c.logprob])


def _normalised(score: float, length: int, length_penalty: float) -> float:
    """`score / length**length_penalty` as generate()'s tensors compute it: a power that overflows
    is inf and one that underflows is 0 (their quotient -inf, or 0), never an exception; not a
    number (0 / 0) ranks last."""
    with np.errstate(all="ignore"):
        out = float(np.float64(score) / np.power(np.float64(length), length_penalty))
    return -math.inf if math.isnan(out) else out
