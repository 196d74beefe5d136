"""AR beam search through the `Verifier` interface: fixed width, or variable width with
absolute-threshold (delta) and max-candidates-per-parent (M) pruning (Freitag & Al-Onaizan 2017).

All live hypotheses are the rows of ONE multi-row verifier session (`core.interfaces.MultiRowSession`):
each iteration is one `step_rows` call that forks every surviving child from its parent's row
(`BeamRow(parent, len(parent), [token])`) and scores the next token of every row in one forward.
Finished hypotheses are not continued, so their rows leave the batch. A verifier whose sessions
have a single row gets the same `step_rows` from `core.multirow.RowsOverSessions`
(one session per row), so the same code runs in-process, over gRPC and on either kind of backend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from core.interfaces import BeamRow, Verifier
from core.multirow import open_rows
from decoding.policies.loop import DecodeStats


@dataclass
class _Hyp:
    tokens: list[int]
    score: float


@dataclass
class _Finished:
    tokens: list[int]
    score: float
    ended_by_eos: bool

    @property
    def length(self) -> int:
        # Length normalisation counts the EOS a hypothesis ended with.
        return len(self.tokens) + int(self.ended_by_eos)


def beam_search(
    verifier: Verifier,
    source_ids: list[int],
    width: int,
    max_new_tokens: int,
    stats: DecodeStats,
    delta: float | None = None,
    max_candidates: int | None = None,
    native_rows: bool = True,
    prefix: list[int] | None = None,
) -> list[int]:
    """The best length-normalised hypothesis. Every hypothesis starts with `prefix` (tokens already
    committed, such as a target language's forced first token, at no cost to its score and counted in
    its length and in `max_new_tokens`). `native_rows=False` forces the single-row-session adapter
    even where the verifier's sessions have `step_rows` (to compare the two)."""
    eos = verifier.eos_id
    per_parent = min(width, max_candidates or width, verifier.vocab_size)
    session = open_rows(verifier, source_ids, native=native_rows)
    try:
        start = list(prefix or [])
        alive = [_Hyp(start, 0.0)]
        rows = [BeamRow(parent=0, committed_len=0, append_ids=start)]  # the session's one row, after the prefix
        finished: list[_Finished] = []
        while alive and len(finished) < width:
            t0 = time.perf_counter()
            results = session.step_rows(rows, per_parent)
            stats.verifier_time_s += time.perf_counter() - t0
            stats.iterations += 1
            # (score, row, rank, token); sorted by score, then row, then rank: ties keep row order.
            candidates = [
                (hyp.score + res.topk_logprobs[0][r], j, r, res.topk_ids[0][r])
                for j, (hyp, res) in enumerate(zip(alive, results, strict=True))
                for r in range(per_parent)
            ]
            candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
            if delta is not None:
                best = candidates[0][0]
                candidates = [c for c in candidates if c[0] >= best - delta]
            grown: list[tuple[int, _Hyp]] = []  # (parent row, child)
            for score, j, _, token in candidates[: width - len(finished)]:
                parent = alive[j]
                if token == eos:
                    finished.append(_Finished(parent.tokens, score, ended_by_eos=True))
                elif len(parent.tokens) + 1 >= max_new_tokens:
                    finished.append(_Finished([*parent.tokens, token], score, ended_by_eos=False))
                else:
                    grown.append((j, _Hyp([*parent.tokens, token], score)))
            rows = [BeamRow(parent=j, committed_len=len(alive[j].tokens), append_ids=child.tokens[-1:])
                    for j, child in grown]
            alive = [child for _, child in grown]
        best = max(finished, key=lambda f: f.score / f.length)
        stats.output_tokens = len(best.tokens)
        stats.finish_reason = "eos" if best.ended_by_eos else "length"
        return best.tokens
    finally:
        session.close()
