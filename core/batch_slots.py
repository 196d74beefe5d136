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


# `split_by_length`'s fixed cost of a forward, in token-rows of padding, per device: on a CPU a
# forward's fixed cost is worth a few dozen token-rows of padding, so a GAD block or a probe among
# one-token rows runs apart (BENCHMARKS.md, "Batch forward and encoder costs (CPU)"). On a GPU the
# fixed cost (kernel launches) dwarfs padded FLOPs: never split there.
SPLIT_TOKENS_CPU = 32


def split_tokens_for(device: str) -> int:
    return SPLIT_TOKENS_CPU if device == "cpu" else 0


# The same for the encoder runs of new sessions' sources (`seq2seq_models.row_cache.encode_new`):
# sources' lengths vary far more than blocks do, and one run padded to the longest of several cost
# more than a run per source, so runs are split where a run's fixed cost is worth less than the
# padding (BENCHMARKS.md, "Batch forward and encoder costs (CPU)", "Encoder runs of new sessions (CPU)").
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
