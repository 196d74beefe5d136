"""Which model worker a new verifier session goes to.

Each worker's forwards attend over the longest source and the longest output among its rows, for
every row (`seq2seq_models.row_cache.KVPool`): a short sentence beside a long one pays for the long
one's positions in every step. In-process bulk runs admit sentences sorted by length; a service
cannot, since requests arrive in any order. So a new session goes to the worker where it adds the
least padding, among those not holding many more sessions than the emptiest (a worker's throughput
grows with its rows, and a worker left with few would idle its core): short sources gather on one
worker and long ones on another, and the workers stay about even. See BENCHMARKS.md, "Bulk
decoding: notes".
"""

from __future__ import annotations

from collections.abc import Sequence


def pick_lane(sources: Sequence[Sequence[int]], length: int) -> int:
    """The index of the worker for a new session of `length` source tokens; `sources[i]`: the
    source lengths of worker i's open sessions. Among equal padding, the worker whose longest source
    is nearest `length` (an empty worker adds no padding either, but left empty it stays free for
    sources unlike those), then the one with fewer sessions, then the first."""
    counts = [len(held) for held in sources]
    # How much busier than the emptiest worker one may be and still take the session.
    slack = max(1, sum(counts) // (4 * len(sources)))
    fewest = min(counts)
    eligible = [i for i, n in enumerate(counts) if n <= fewest + slack]
    return min(eligible, key=lambda i: (_added_padding(sources[i], length),
                                        abs(max(sources[i], default=0) - length), counts[i], i))


def _added_padding(held: Sequence[int], length: int) -> int:
    """Source positions a worker's forwards attend over, more with the new session than without:
    every row is padded to the longest source held."""
    longest = max(held, default=0)
    return (len(held) + 1) * max(longest, length) - len(held) * longest - length
