"""Speculation that adapts to load: the block length k of every draft-verify step, chosen per
request and step to maximise expected goodput. `DecodingConfig.adaptive` turns it on; the lossless
modes stay identical to greedy whatever k is chosen, since k only decides how much is drafted,
never what is accepted. The design and its reasons are ARCHITECTURE.md, "Performance design",
"Adaptive speculation"; the measurements behind it, BENCHMARKS.md, "Adaptive speculation: notes".

The rule: a step drafting k tokens commits E(k) = (1 - a^(k+1)) / (1 - a) tokens in expectation (a:
the request's acceptance rate; k = 0 is a plain AR step, no drafter call) and costs its share of a
verifier forward, c0/rows + cr + c1*(1 + k), plus, when k > 0, a drafter call d0' + dr + d1*(1 + k).
The policy picks

    k* = argmax_{0 <= k <= k_max}  E(k) / (c0/rows + cr + c1*(1 + k) + [k > 0] * (d0' + dr + d1*(1 + k)))

When a batch's rows behave alike, each request maximising its own ratio maximises the server's
throughput: long blocks win when a forward is latency-bound (one request), k = 0 when a batch is
compute-bound, which is how a loaded server speculating adaptively stays no slower than plain AR.

The estimates:
- a: per request, accepted draft tokens over draft positions reached, with the mode's pooled rate
  over recent blocks of every request as its prior (worth PRIOR_WEIGHT positions).
- c0, cr, c1 (and d0, dr, d1 for the drafter): `forward_cost.CostEstimator`, one per verifier (per
  gateway process) and one per drafter mode, fitted from the (rows, tokens, seconds) every answer
  reports of the forward it ran in. The per-row term cr exists because a draft token adds only c1
  to a forward while a plain AR row adds cr + c1. d0' = d0/rows when the drafter reports its
  forwards (its scheduler batches the blocks of every drafting request), the whole d0 when it
  reports none. A request's first draft is not a cost sample: it opens the drafter session.
- rows: the requests decoding on this verifier now (`decode` counts them), or the last forward's
  rows when more; never the last forward's rows alone, which drafting requests leave half empty.

Probing: while k = 0 wins nothing is learnt about acceptance, so after PROBE_AFTER plain AR steps
of a mode one step drafts PROBE_K tokens, the interval doubling up to PROBE_MAX_INTERVAL per
ROWS_PER_RUN requests in flight. A probe is made only where drafts as good as PROBE_CEILING would
be drafted at this load; where even those lose to plain AR, a probe could change no choice and is
pure cost. Cost observations expire after MAX_AGE_S.
"""
from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from core.interfaces import Draft, VerifyResult, load_key_of
from decoding.config import DecodingConfig
from decoding.policies.forward_cost import FREE, Cost, CostEstimator
from decoding.policies.loop import Accept, Propose

# propose(output so far, most tokens worth drafting, block length k) -> a draft of at most k tokens
# (and the room). Given the room apart from k, a drafter may use what lies past the block
# (`Draft.lookahead`).
SizedPropose = Callable[[list[int], int, int], Draft]

DEFAULT_RATE = 0.8  # the prior acceptance rate before the mode has any pooled data
PRIOR_WEIGHT = 4.0  # draft positions the prior is worth against a request's own blocks
POOL_DECAY = 0.99  # per block folded into the pooled rate: it follows the last few hundred
PROBE_K = 2
PROBE_AFTER = 8
# Plain AR steps one k = 0 choice commits to, per 4 rows of load (`ar_run`): a verifier that runs
# several per call (`GreedySession`) takes them in one round trip, as AR greedy does, so a loaded
# server speculating adaptively is not slower than plain AR for want of runs. The choice is made
# again after them. Under load the runs grow: a round trip costs both services' Python and takes
# the session out of the verifier's batch until the next call arrives, while under load k = 0 keeps
# winning (BENCHMARKS.md, "Adaptive speculation: notes"). Where no acceptance rate would make
# drafting pay at this load (a "hopeless" k = 0, `AdaptiveBlocks.propose`), the run goes to the end
# of the output instead.
AR_RUN = 8
ROWS_PER_RUN = 4
PROBE_MAX_INTERVAL = 64
PROBE_CEILING = 0.95  # the best acceptance rate a probe could find (module docstring: probing)


def maybe_adaptive(
    config: DecodingConfig, load: LoadModel, propose: SizedPropose, accept: Accept
) -> tuple[Propose, Accept]:
    """The (propose, accept) pair of a draft-verify mode, made adaptive (on `load`) when
    `config.adaptive`; else every block asks for `config.k` tokens."""
    if not config.adaptive:
        return (lambda output, room: propose(output, room, config.k)), accept
    blocks = AdaptiveBlocks(load, config.mode.value, config.k, propose, accept)
    return blocks.propose, blocks.accept


def expected_tokens(a: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k: tokens one step commits when each draft token passes with rate a."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)



def step_cost(k: int, rows: int, verifier: Cost, drafter: Cost, drafter_shared: bool = False) -> float:
    """A request's share of the forwards of one step drafting k tokens (module docstring)."""
    rows = max(rows, 1)
    cost = verifier.c0 / rows + verifier.cr + verifier.c1 * (1 + k)
    if k > 0:
        # The drafter's row feeds its append (usually the verifier's last token) and k masks.
        fixed = drafter.c0 / rows if drafter_shared else drafter.c0  # see "The drafter's fixed cost"
        cost += fixed + drafter.cr + drafter.c1 * (1 + k)
    return cost


def ar_run(rows: int) -> int:
    """Plain AR steps one k = 0 choice runs at a load of `rows` (see AR_RUN)."""
    return AR_RUN * load_steps(rows)


def load_steps(rows: int) -> int:
    """How many times longer AR runs and the probe interval's cap are at a load of `rows`."""
    return max(1, rows // ROWS_PER_RUN)


def choose_block_length(a: float, k_max: int, rows: int, verifier: Cost, drafter: Cost,
                        drafter_shared: bool = False) -> int:
    """argmax over k in 0..k_max of E(k) / step_cost(k); the shorter block on a tie."""
    best_k, best = 0, -1.0
    for k in range(max(k_max, 0) + 1):
        cost = step_cost(k, rows, verifier, drafter, drafter_shared)
        value = math.inf if cost <= 0 else expected_tokens(a, k) / cost
        if value > best:
            best_k, best = k, value
    return best_k


class Acceptance:
    """Accepted draft tokens and draft positions reached (Beta-style counts)."""

    def __init__(self, accepted: float = 0.0, reached: float = 0.0) -> None:
        self.accepted = accepted
        self.reached = reached

    def add(self, drafted: int, accepted: int, decay: float = 1.0) -> None:
        self.accepted = self.accepted * decay + accepted
        self.reached = self.reached * decay + min(drafted, accepted + 1)

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.reached + weight)


class LoadModel:
    """What one gateway process learns about its load, shared by all its requests: the verifier's
    cost, the drafter's per mode, and the pooled acceptance rate per mode (the prior of a new
    request). Thread-safe."""

    def __init__(self) -> None:
        self.in_flight = 0  # requests decoding on this verifier now (`decoding`)
        self.verifier_cost = CostEstimator()
        self._drafter_costs: dict[str, CostEstimator] = {}
        self._drafter_batches: set[str] = set()  # modes whose drafter reports its forwards
        self._pooled: dict[str, Acceptance] = {}
        self._probes: dict[str, list[int]] = {}  # mode -> [plain AR steps since the last probe, interval]
        self._lock = threading.Lock()

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Count one request in `in_flight` while it decodes."""
        with self._lock:
            self.in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1

    def drafter_cost(self, mode: str) -> CostEstimator:
        with self._lock:
            return self._drafter_costs.setdefault(mode, CostEstimator(prior=FREE))

    def observe_draft(self, mode: str, k: int, draft: Draft, wall_s: float, first: bool) -> None:
        """Learn the drafter's cost from one draft of k tokens: the forward it ran in, as the
        drafter's scheduler reports it; else (a drafter without one) the call's wall time, though
        not a request's first, which opened its drafter session ("d0, d1" in the module docstring)."""
        if draft.batch_tokens > 0 and draft.forward_s > 0:
            with self._lock:
                self._drafter_batches.add(mode)
            self.drafter_cost(mode).observe(max(draft.batch_rows, 1), draft.batch_tokens, draft.forward_s)
        elif not first:
            self.drafter_cost(mode).observe(1, 1 + k, wall_s)

    def prior_rate(self, mode: str) -> float:
        with self._lock:
            pooled = self._pooled.get(mode)
            return DEFAULT_RATE if pooled is None else pooled.rate(DEFAULT_RATE, 1.0)

    def pool(self, mode: str, drafted: int, accepted: int) -> None:
        with self._lock:
            self._pooled.setdefault(mode, Acceptance()).add(drafted, accepted, POOL_DECAY)

    def probe(self, mode: str, drafting: bool, rows: int = 1) -> bool:
        """Count a step of the mode: True when this plain AR step should draft a probe instead.
        `rows`: the load (the interval's cap grows with it, see the module docstring).

        The schedule is the gateway's, not each request's: under load every request would otherwise
        pay its own probes, and a new request's prior is the pooled rate the probes keep fresh."""
        with self._lock:
            state = self._probes.setdefault(mode, [0, PROBE_AFTER])
            if drafting:
                state[:] = [0, PROBE_AFTER]
                return False
            state[0] += 1
            # An interval grown under a heavier load is cut to this load's cap at once: after a burst,
            # a light load would otherwise wait out the burst's long interval before its first probe.
            cap = PROBE_MAX_INTERVAL * load_steps(rows)
            if state[0] < min(state[1], cap):
                return False
            state[:] = [0, min(2 * state[1], cap)]
            return True

    def count_plain_steps(self, mode: str, steps: int) -> None:
        """Plain AR steps of a run after its first (which `probe` counted) bring the next probe closer."""
        with self._lock:
            self._probes.setdefault(mode, [0, PROBE_AFTER])[0] += steps

    def choose(self, mode: str, a: float, k_max: int, rows: int) -> int:
        """The block length for one step (subclass to force a policy, e.g. in tests)."""
        return choose_block_length(a, k_max, rows, self.verifier_cost.cost(), self.drafter_cost(mode).cost(),
                                   drafter_shared=mode in self._drafter_batches)


# One LoadModel per verifier: per verifier object in process, per `load_key` where the verifier
# object is made per request (the gateway's RemoteVerifier and TritonVerifier name the channel or
# client they share), so one model per gateway process; an in-process caller with several
# verifiers (tests, benchmarks) keeps their costs apart.
_MODELS: weakref.WeakKeyDictionary[object, LoadModel] = weakref.WeakKeyDictionary()
_MODELS_LOCK = threading.Lock()


def load_model(verifier: object) -> LoadModel:
    key = load_key(verifier)
    with _MODELS_LOCK:
        model = _MODELS.get(key)
        if model is None:
            model = _MODELS[key] = LoadModel()
        return model


def load_key(verifier: object) -> object:
    """What a verifier's load is learnt per (`core.interfaces.load_key_of`)."""
    return load_key_of(verifier)


class AdaptiveBlocks:
    """One request's adaptive policy around a mode's (propose, accept): `propose` chooses k and asks
    the mode's own propose for at most k tokens (none at all for k = 0); `accept` applies the mode's
    rule, then learns from the step (acceptance, the verifier's forward, the drafter's call)."""

    def __init__(self, load: LoadModel, mode: str, k_max: int, propose: SizedPropose, accept: Accept) -> None:
        self.load = load
        self.mode = mode
        self.k_max = k_max
        self._propose = propose
        self._accept = accept
        self.own = Acceptance()
        self.prior = load.prior_rate(mode)
        self.rows = 1  # the last forward's rows (see "rows" in the module docstring)
        self.chosen: list[int] = []  # k chosen at every step (stats, tests)
        self._verified = -1  # output tokens the verifier's cache holds (-1: not even BOS yet)
        self._step: tuple[float, int] | None = None  # (when the verifier was called, own tokens)
        self._drafted = False  # whether a draft was made (the first opened the drafter session)

    @property
    def rate(self) -> float:
        return self.own.rate(self.prior, PRIOR_WEIGHT)

    def propose(self, output: list[int], room: int) -> Draft:
        limit = min(self.k_max, room)
        rows = max(self.rows, self.load.in_flight)
        k = min(self.load.choose(self.mode, self.rate, limit, rows), limit) if limit > 0 else 0
        # Hopeless: even drafts as good as PROBE_CEILING would lose to plain AR at this load.
        hopeless = k == 0 and (limit == 0 or self.load.choose(self.mode, PROBE_CEILING, limit, rows) == 0)
        if self._worth_probing(k, hopeless) and self.load.probe(self.mode, drafting=k > 0, rows=rows):
            k = min(PROBE_K, limit)
        self.chosen.append(k)
        if k > 0:
            t0 = time.perf_counter()
            draft = self._propose(output, room, k)
            self.load.observe_draft(self.mode, k, draft, time.perf_counter() - t0, first=not self._drafted)
            self._drafted = True
        else:
            # A hopeless k = 0 runs to the end of the output: only a fall in load could change the
            # choice, and every extra run costs a round trip that a loaded server pays out of its
            # forwards (BENCHMARKS.md, "Adaptive speculation: notes").
            draft = Draft(ids=[], ar_steps=room + 1 if hopeless else min(ar_run(rows), room + 1))
        own_tokens = max(1, len(output) - self._verified + min(len(draft.ids), k))
        self._verified = len(output)
        self._step = (time.perf_counter(), own_tokens)
        return draft

    def _worth_probing(self, k: int, hopeless: bool) -> bool:
        """Whether this step counts towards the probe schedule: a drafting step (it resets the
        schedule), or a plain one where drafts as good as PROBE_CEILING would be drafted at this load
        (and this request's own rate is below that: a probe could teach it something)."""
        return k > 0 or (not hopeless and self.rate < PROBE_CEILING)

    def accept(self, ids: list[int], draft: Draft, res: VerifyResult) -> tuple[int, int]:
        accepted, token = self._accept(ids, draft, res)
        if self._step is not None:  # the loop skips propose only on a last step with no room
            t0, own_tokens = self._step
            wall = time.perf_counter() - t0
            if res.batch_tokens > 0 and res.forward_s > 0:
                self.load.verifier_cost.observe(max(res.batch_rows, 1), res.batch_tokens, res.forward_s)
            else:
                self.load.verifier_cost.observe(1, own_tokens, wall)
        self.rows = max(res.batch_rows, 1)
        self._step = None
        if ids:
            self.own.add(len(ids), accepted)
            self.load.pool(self.mode, len(ids), accepted)
        elif len(res.top1) > 1:  # a run of plain AR steps (Draft.ar_steps): its tokens but the last are cached
            self.load.count_plain_steps(self.mode, len(res.top1) - 1)
            self._verified += len(res.top1) - 1
        self._verified += accepted  # accepted drafts are in the verifier's cache; its token is not yet
        return accepted, token
