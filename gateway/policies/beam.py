"""AR beam search through the `Verifier` interface: fixed width, or variable width with
absolute-threshold (delta) and max-candidates-per-parent (M) pruning (Freitag & Al-Onaizan 2017).

Every live hypothesis sits in its own verifier session. A session is re-targeted to a new
hypothesis with the session protocol itself: roll back to the common prefix, append the rest,
so no "fork" call is needed and the same code runs in-process and over gRPC.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from core.interfaces import Verifier, VerifierSession
from gateway.policies.loop import DecodeStats, PrefixSync


@dataclass
class _Slot:
    session: VerifierSession
    sync: PrefixSync


@dataclass
class _Hyp:
    tokens: list[int]
    score: float
    slot: _Slot | None = None


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
) -> list[int]:
    eos = verifier.eos_id
    per_parent = min(width, max_candidates or width, verifier.vocab_size)
    slots: list[_Slot] = []
    try:
        alive = [_Hyp([], 0.0, _open(verifier, source_ids, slots))]
        finished: list[_Finished] = []
        while alive and len(finished) < width:
            candidates = []
            t0 = time.perf_counter()
            for j, hyp in enumerate(alive):
                slot = hyp.slot
                assert slot is not None
                committed, append = slot.sync.delta(hyp.tokens)
                res = slot.session.step(committed, append, [], per_parent)
                slot.sync.seen = list(hyp.tokens)
                for r in range(per_parent):
                    candidates.append((hyp.score + res.topk_logprobs[0][r], j, r, res.topk_ids[0][r]))
            stats.verifier_time_s += time.perf_counter() - t0
            stats.iterations += 1
            candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
            if delta is not None:
                best = candidates[0][0]
                candidates = [c for c in candidates if c[0] >= best - delta]
            grown: list[tuple[_Hyp, _Hyp]] = []  # (parent, child)
            for score, j, _, token in candidates[: width - len(finished)]:
                parent = alive[j]
                if token == eos:
                    finished.append(_Finished(parent.tokens, score, ended_by_eos=True))
                elif len(parent.tokens) + 1 >= max_new_tokens:
                    finished.append(_Finished([*parent.tokens, token], score, ended_by_eos=False))
                else:
                    grown.append((parent, _Hyp([*parent.tokens, token], score)))
            alive = _assign_slots(grown, alive, verifier, source_ids, slots)
        best = max(finished, key=lambda f: f.score / f.length)
        stats.output_tokens = len(best.tokens)
        stats.finish_reason = "eos" if best.ended_by_eos else "length"
        return best.tokens
    finally:
        for slot in slots:
            slot.session.close()


def _assign_slots(
    grown: list[tuple[_Hyp, _Hyp]],
    old: list[_Hyp],
    verifier: Verifier,
    source_ids: list[int],
    slots: list[_Slot],
) -> list[_Hyp]:
    """Give each child a session: its parent's if still free (a one-token append), else the free
    session sharing the longest prefix with it, else a new one."""
    free = [h.slot for h in old if h.slot is not None]
    taken: set[int] = set()
    children = [child for _, child in grown]
    pending = []
    for parent, child in grown:
        if parent.slot is not None and id(parent.slot) not in taken:
            child.slot = parent.slot
            taken.add(id(parent.slot))
        else:
            pending.append(child)
    for child in pending:
        options = [s for s in free if id(s) not in taken]
        if options:
            slot = max(options, key=lambda s: s.sync.delta(child.tokens)[0])
        else:
            slot = _open(verifier, source_ids, slots)
        child.slot = slot
        taken.add(id(slot))
    return children


def _open(verifier: Verifier, source_ids: list[int], slots: list[_Slot]) -> _Slot:
    slot = _Slot(verifier.open(source_ids), PrefixSync())
    slots.append(slot)
    return slot
