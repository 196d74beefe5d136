"""One outcome per item of a batched model call, written once for the verifier's `step_batch` and
the NAR drafter's `draft_rows`: each item is planned on its own (its exception goes in its slot and
it stays out of the forward), a session may appear once per batch, and a failing forward fails
exactly the items that were in it."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any

from core.errors import out_of_step


def answer_in_slots(
    items: Sequence[tuple[Any, Any]],
    plan: Callable[[int, Any, Any], Any],
    run: Callable[[list[Any], list[Any]], None],
    what: str = "step",
) -> list[Any]:
    """`plan(slot, session, request)` validates one item and returns its plan; `run(plans, outcomes)`
    runs one forward over the plans and fills their slots of `outcomes`."""
    outcomes: list[Any] = [None] * len(items)
    planned: list[tuple[int, Any]] = []
    seen: set[int] = set()
    for slot, (session, request) in enumerate(items):
        try:
            if id(session) in seen:
                raise out_of_step(f"the session already has a {what} in this batch")
            planned.append((slot, plan(slot, session, request)))
            seen.add(id(session))
        except Exception as e:  # the item's own failure goes in its slot
            outcomes[slot] = e
    if planned:
        try:
            run([p for _, p in planned], outcomes)
        except Exception as e:  # a failed forward fails the items in it
            for slot, _ in planned:
                outcomes[slot] = e
    return outcomes


# `split_by_length`'s fixed cost of a forward, in token-rows of padding, per device. On a CPU a
# batched verifier forward costs about c0 + a*rows + b*rows*block_len with c0/b ~ 35 token-rows
# (bench/bench_batch_forward.py --blocks; 2.5 ms fixed, 0.07 ms a token-row on the 2-core machine): one
# 3-token probe among 25 one-token rows pads 50 token-rows, and a GAD block of 11 among them 250.
# On a GPU the fixed cost (kernel launches) dwarfs padded FLOPs: never split there.
SPLIT_TOKENS_CPU = 32


def split_tokens_for(device: str) -> int:
    return SPLIT_TOKENS_CPU if device == "cpu" else 0


# The same for the encoder runs of new sessions' sources (`seq2seq_models.row_cache.encode_new`). On
# the 2-core CPU a one-source run of the UA-GEC verifier's encoder (ONNX Runtime) took 4.7 / 7.4 /
# 13.2 ms at 10 / 30 / 60 tokens: ~2.9 ms fixed, ~0.17 ms a token, so ~16 tokens. The sources' lengths
# vary far more than blocks do (UA-GEC test: median 21 tokens, 90th percentile 52, longest 106): one
# run padded to the longest of 8 or 16 of them cost more than one run per source, and under load
# (about 4 sources a run at 32 clients) the encoder took a larger share of the verifier's work than
# one source at a time; split, 1.2-1.4x less per source (bench/bench_encoder_batch.py).
SPLIT_SOURCE_TOKENS_CPU = 16


def split_source_tokens_for(device: str) -> int:
    return SPLIT_SOURCE_TOKENS_CPU if device == "cpu" else 0


def split_by_length(lengths: Sequence[int], fixed_cost: float) -> list[list[int]]:
    """The indices of `lengths` (the block lengths of one batch's rows) grouped into forwards.

    A forward pads every row to its longest block, so it costs about `fixed_cost` + rows * longest,
    in token-rows. The groups minimise the sum of that over the forwards (rows sorted by length;
    the best cut points by dynamic programming over the distinct lengths, a handful). With
    `fixed_cost` <= 0, one group: never split. Each group lists its indices in their original order."""
    if fixed_cost <= 0 or len(set(lengths)) < 2:
        return [list(range(len(lengths)))]
    distinct = sorted(set(lengths))
    counts = [sum(1 for n in lengths if n == d) for d in distinct]
    # best[j]: the cost of the rows with the j shortest distinct lengths; cut[j]: where its last group starts.
    best = [0.0] + [math.inf] * len(distinct)
    cut = [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        rows = 0
        for i in range(j, 0, -1):  # the last group holds distinct lengths i-1 .. j-1
            rows += counts[i - 1]
            cost = best[i - 1] + fixed_cost + rows * distinct[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    bounds: list[int] = []
    j = len(distinct)
    while j > 0:
        bounds.append(distinct[cut[j]])
        j = cut[j]
    bounds.sort()
    groups: list[list[int]] = [[] for _ in bounds]
    for index, n in enumerate(lengths):
        groups[bisect.bisect_right(bounds, n) - 1].append(index)
    return groups
