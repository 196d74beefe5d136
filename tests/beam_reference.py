"""AR beam search as it was before multi-row verifier sessions (decoding/policies/beam.py at
dde4ce7), and before beam search became `generate`'s: one single-row verifier session per live
hypothesis, re-targeted by rolling back to the common prefix; each finished hypothesis takes one of
the `width` places and the search ends when `width` are finished. Frozen: bench/bench_beam.py times
it and counts the outputs the present search shares with it. Do not change what it computes."""

from __future__ import annotations

import time
from dataclasses import dataclass

from core.interfaces import VerifierSession
from decoding.policies.loop import PrefixSync


@dataclass
class _Slot:
    session: VerifierSession
    sync: PrefixSync


@dataclass
class _Hyp:
    tokens: list[int]
    score: float
    slot: _Slot | None = None


# A finished hypothesis: (tokens, score, ended by EOS); its length for normalisation counts that EOS.
_Finished = tuple[list[int], float, bool]


def reference_beam_search(verifier, source_ids, width, max_new_tokens, stats, delta=None, max_candidates=None):
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
            grown: list[tuple[_Hyp, _Hyp]] = []
            for score, j, _, token in candidates[: width - len(finished)]:
                parent = alive[j]
                if token == eos:
                    finished.append((parent.tokens, score, True))
                elif len(parent.tokens) + 1 >= max_new_tokens:
                    finished.append(([*parent.tokens, token], score, False))
                else:
                    grown.append((parent, _Hyp([*parent.tokens, token], score)))
            alive = _assign_slots(grown, alive, verifier, source_ids, slots)
        best_tokens, _, best_ended_by_eos = max(finished, key=lambda f: f[1] / (len(f[0]) + int(f[2])))
        stats.output_tokens = len(best_tokens)
        stats.finish_reason = "eos" if best_ended_by_eos else "length"
        return best_tokens
    finally:
        for slot in slots:
            slot.session.close()


def _assign_slots(grown, old, verifier, source_ids, slots):
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


def _open(verifier, source_ids, slots):
    slot = _Slot(verifier.open(source_ids), PrefixSync())
    slots.append(slot)
    return slot
