"""What a forward costs, learnt online: `Cost` (c0 + cr*rows + c1*tokens) and `CostEstimator`, which
fits it from the (rows, tokens, seconds) of the forwards a service reports. Adaptive speculation
(`decoding.policies.adaptive`, module docstring: "The rule", "The estimates") prices its block
lengths with one per verifier and one per drafter mode.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

BUCKET_SIZE = 16  # observations kept per bucket (power of two of the rows, power of two of the tokens)
MAX_BUCKET = 20  # forwards of up to 2^20 rows and tokens
OUTLIER = 3.0  # an observation over this many times its bucket's median is a stall, not a cost
WARMUP = 1  # first observations of an estimator ignored (lazy session start, a first channel call)
MAX_AGE_S = 60.0  # observations older than this are forgotten (so a stale bucket cannot freeze k)
HALF_LIFE_S = 5.0  # a bucket's weight in the fit halves every this many seconds since its last observation
MIN_WEIGHT = 1e-3


@dataclass(frozen=True)
class Cost:
    """cost(rows, tokens) = c0 + cr * rows + c1 * tokens, in seconds: a forward's fixed cost, its
    cost per row and per token (`decoding.policies.adaptive`, module docstring, "The rule")."""

    c0: float
    c1: float
    cr: float = 0.0

    def __call__(self, rows: float, tokens: float) -> float:
        return self.c0 + self.cr * rows + self.c1 * tokens


FREE = Cost(0.0, 0.0)


class CostEstimator:
    """cost(rows, tokens) ~ c0 + cr*rows + c1*tokens learned online from (rows, tokens, seconds)
    observations; thread-safe.

    Each bucket (power of two of the rows, power of two of the tokens) keeps its last BUCKET_SIZE
    observations; the fit is least squares through the buckets' mean (rows, tokens, seconds) less
    their stalls, weighted by relative error and recency (`fit_cost`). Where the buckets cannot tell the three
    apart, what they can tell is split as `memory`, the last fit that could, split it (see
    `fit_cost`; kept when the observations behind it expire: how a forward's cost divides is the
    model's and the host's, not the load's)."""

    def __init__(self, prior: Cost = Cost(1.0, 0.0), clock: Callable[[], float] = time.monotonic) -> None:
        self.prior = prior  # the cost before any observation
        self.clock = clock
        self.memory: Cost | None = None  # the last fit that told c0, cr and c1 apart
        self._buckets: dict[tuple[int, int], deque[tuple[float, float, float, float]]] = {}
        # Each bucket's `_summary`, kept until the bucket changes: the fit runs after every step's
        # observation, and re-summarising every bucket each time was most of its cost.
        self._summaries: dict[tuple[int, int], tuple[float, float, float, float]] = {}
        self._lock = threading.Lock()
        self._warmup = WARMUP
        self._cost: Cost | None = None
        self._oldest = math.inf

    def observe(self, rows: float, tokens: float, seconds: float) -> None:
        if not (rows >= 1 and tokens >= 0 and seconds >= 0 and math.isfinite(seconds)):
            return
        bucket = (min(int(rows).bit_length(), MAX_BUCKET), min(int(tokens).bit_length(), MAX_BUCKET))
        with self._lock:
            if self._warmup > 0:
                self._warmup -= 1
                return
            now = self.clock()
            self._buckets.setdefault(bucket, deque(maxlen=BUCKET_SIZE)).append(
                (float(rows), float(tokens), float(seconds), now))
            self._oldest = min(self._oldest, now)
            self._summaries.pop(bucket, None)
            self._cost = None

    def cost(self) -> Cost:
        with self._lock:
            now = self.clock()
            if self._oldest < now - MAX_AGE_S:
                self._forget(now - MAX_AGE_S)
            if self._cost is None:
                summaries = [self._summary(bucket) for bucket in self._buckets]
                points = [p[:3] for p in summaries]
                # Relative errors (a bucket of 1-row forwards counts as much as one of 32-row ones),
                # recent buckets first (see `fit_cost`).
                weights = [max(0.5 ** ((now - p[3]) / HALF_LIFE_S), MIN_WEIGHT) / max(p[2], 1e-9) ** 2
                           for p in summaries]
                self._cost = fit_cost(points, self.memory, weights) if points else self.prior
                if _identified(points):
                    self.memory = self._cost
            return self._cost

    def _summary(self, bucket: tuple[int, int]) -> tuple[float, float, float, float]:
        summary = self._summaries.get(bucket)
        if summary is None:
            summary = self._summaries[bucket] = _summary(self._buckets[bucket])
        return summary

    def _forget(self, before: float) -> None:
        for bucket, obs in list(self._buckets.items()):
            if obs[0][3] < before:
                self._summaries.pop(bucket, None)
            while obs and obs[0][3] < before:
                obs.popleft()
            if not obs:
                del self._buckets[bucket]
        self._oldest = min((obs[0][3] for obs in self._buckets.values()), default=math.inf)
        self._cost = None


def _summary(obs: deque[tuple[float, float, float, float]]) -> tuple[float, float, float, float]:
    """A bucket's mean (rows, tokens, seconds) without its stalls, and when it was last observed.
    Observations over OUTLIER times the median (a pause of the host, a garbage collection) are
    dropped; the mean of the rest is unbiased for a plane."""
    ceiling = OUTLIER * statistics.median(o[2] for o in obs)
    kept = [o for o in obs if o[2] <= ceiling]
    rows, tokens, seconds = (sum(o[i] for o in kept) / len(kept) for i in range(3))
    return rows, tokens, seconds, obs[-1][3]


SPREAD = 1.5  # rows (or tokens per row) must differ this many times between buckets to tell costs apart


def _identified(points: list[tuple[float, float, float]]) -> bool:
    """Whether the points tell c0, cr and c1 apart: three or more, their rows differ (or cr is c0)
    and so do their tokens per row (or cr is c1)."""
    return len(points) >= 3 and _varies([r for r, _, _ in points]) and _varies([t / r for r, t, _ in points])


def _varies(values: list[float]) -> bool:
    return max(values) >= SPREAD * min(values)


def fit_cost(points: list[tuple[float, float, float]], memory: Cost | None = None,
             weights: list[float] | None = None) -> Cost:
    """Least squares c0 + cr*rows + c1*tokens through `points` (rows, tokens, seconds), weighted by
    `weights` (default: all alike), every coefficient >= 0.

    The estimator weighs each bucket by 1 / seconds^2 (relative errors: with absolute ones the
    32-row buckets, many times a one-row forward's cost, decide the fit and a one-row bucket hardly counts)
    and by how recently it was observed (halving every HALF_LIFE_S): the cost of a forward depends
    on what else the host runs (drafter and verifier share the cores of a CPU host, so their forwards
    take longer while both are busy), and after a change of load the buckets the new load keeps
    observing must decide the fit: forwards timed under a heavy load otherwise price a light load's
    drafts far too high (BENCHMARKS.md, "Adaptive speculation: notes").

    Where the points cannot tell the three apart, a line c0 + s*tokens is fitted
    and divided as `memory` divides (without one: cr = 0, which prices drafting high):

    - every bucket at about the same rows R (one client: R = 1), tokens varying: c0 + cr*R is the
      line's c0, divided between c0 and cr;
    - about the same tokens per row q (plain AR traffic: q = 1): cr/q + c1 is its slope, divided
      between cr and c1;
    - both (one bucket): the line is flat, and the level is memory's shape scaled to it.

    Why it matters: after a spell at one client, a fit that put all of c0 + cr in c0 left adaptive
    GAD at 32 clients drafting far less than after a cold start at that load, and slower than plain
    AR (BENCHMARKS.md, "Adaptive speculation: notes")."""
    weights = weights or [1.0] * len(points)
    if _identified(points):
        return _non_negative_least_squares(points, weights)
    line = fit_line([(t, y) for _, t, y in points], weights)
    rows = sum(r for r, _, _ in points) / len(points)
    per_row = sum(t / r for r, t, _ in points) / len(points)
    if memory is None or memory(rows, rows * per_row) <= 0:
        return line
    if len(points) > 1 and _varies([r for r, _, _ in points]):  # tokens per row alike: split the slope
        share = memory.cr / (memory.cr + memory.c1) if memory.cr + memory.c1 > 0 else 0.0
        unit = line.c1 / (share / per_row + 1.0 - share)
        return Cost(line.c0, unit * (1.0 - share), unit * share)
    if len(points) > 1 and _varies([t / r for r, t, _ in points]):  # rows alike: split the intercept
        fixed = memory.c0 + memory.cr * rows
        part = memory.c0 / fixed if fixed > 0 else 1.0
        return Cost(line.c0 * part, line.c1, line.c0 * (1.0 - part) / rows)
    scale = line(rows, rows * per_row) / memory(rows, rows * per_row)
    return Cost(memory.c0 * scale, memory.c1 * scale, memory.cr * scale)


def _non_negative_least_squares(points: list[tuple[float, float, float]], weights: list[float]) -> Cost:
    """The best non-negative (c0, cr, c1): the least-squares solution of each subset of the three
    (the others held at 0) that comes out non-negative, the one with the smallest residual. Every
    subset's normal equations and residual come from the points' weighted moments, summed once."""
    features = [(1.0, r, t) for r, t, _ in points]  # the columns of c0, cr, c1
    y = [s for _, _, s in points]
    gram = [[sum(w * f[i] * f[j] for f, w in zip(features, weights, strict=True)) for j in range(3)]
            for i in range(3)]
    moment = [sum(w * f[i] * v for f, v, w in zip(features, y, weights, strict=True)) for i in range(3)]
    yy = sum(w * v * v for v, w in zip(y, weights, strict=True))
    best, best_sse = Cost(0.0, 0.0), yy
    for subset in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)):
        coef = _solve([[gram[i][j] for j in subset] for i in subset], [moment[i] for i in subset])
        if coef is None or min(coef) < 0:
            continue
        # The residual: yy - 2 coef.moment + coef' gram coef, which at the solution is yy - coef.moment.
        sse = yy - sum(c * moment[i] for c, i in zip(coef, subset, strict=True))
        if sse < best_sse * (1 - 1e-12):
            fitted = dict(zip(subset, coef, strict=True))
            best, best_sse = Cost(fitted.get(0, 0.0), fitted.get(2, 0.0), fitted.get(1, 0.0)), sse
    return best


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b (at most three unknowns), by Gauss-Jordan with partial pivoting; None when
    singular."""
    n = len(b)
    rows = [[*a[i], b[i]] for i in range(n)]
    scale = max(abs(v) for row in a for v in row)
    for i in range(n):
        pivot = max(range(i, n), key=lambda r: abs(rows[r][i]))
        if abs(rows[pivot][i]) <= 1e-12 * max(scale, 1e-300):
            return None
        rows[i], rows[pivot] = rows[pivot], rows[i]
        for r in range(n):
            if r != i:
                f = rows[r][i] / rows[i][i]
                rows[r] = [x - f * z for x, z in zip(rows[r], rows[i], strict=True)]
    return [rows[i][n] / rows[i][i] for i in range(n)]


def fit_line(points: list[tuple[float, float]], weights: list[float] | None = None) -> Cost:
    """Least squares c0 + c1*x through `points` (x, seconds), weighted by `weights` (default: all
    alike), constrained to c0, c1 >= 0."""
    w = weights or [1.0] * len(points)
    total = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True)) / total
    my = sum(wi * y for wi, (_, y) in zip(w, points, strict=True)) / total
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points, strict=True))
    sxy = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points, strict=True))
    c1 = sxy / sxx if sxx > 1e-12 * total * max(mx * mx, 1.0) else 0.0
    if c1 <= 0:
        return Cost(max(my, 0.0), 0.0)
    c0 = my - c1 * mx
    if c0 < 0:  # the best line through the origin
        return Cost(0.0, sum(wi * x * y for wi, (x, y) in zip(w, points, strict=True))
                    / sum(wi * x * x for wi, (x, _) in zip(w, points, strict=True)))
    return Cost(c0, c1)
