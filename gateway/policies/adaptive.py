"""Speculation that adapts to load: the block length k of every draft-verify step, chosen per
request and step to maximise expected goodput (ARCHITECTURE.md section 8). `DecodingConfig.adaptive`
turns it on; the lossless modes stay identical to greedy whatever k is chosen, since k only
decides how much is drafted, never what is accepted.

The objective
-------------
A step that drafts k tokens commits in expectation E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)
tokens, where a is the request's per-token acceptance rate (a draft token is accepted with
probability a once its predecessors were; the verifier's own token always comes). k = 0 is a plain
AR step: no drafter call, one token.

A step costs a share of two forwards. The verifier's forward over `rows` rows and T tokens (every
row of every request in the batch, append + draft) takes cost(rows, T) ~ c0 + cr*rows + c1*T: c0 is
paid once per forward whatever its size (reading the weights, kernel launches, the scheduler's
round), cr once per row (attention over the row's cached past and its source, gathering and
scattering its K/V, its head call), c1 per token fed (the FLOPs of the layers). A request feeding
1 + k tokens to a forward of `rows` rows is charged c0/rows + cr + c1*(1+k); its drafter call, one
row of 1 + k tokens (the token it appends, k masks), d0' + dr + d1*(1+k) (nothing when k = 0). The
policy picks

    k* = argmax_{0 <= k <= k_max}  E(k) / (c0/rows + cr + c1*(1 + k) + [k > 0] * (d0' + dr + d1*(1 + k)))

Why the per-row term: a draft token adds only c1 to the verifier's forward, a plain AR step costs
cr + c1 more than its share of c0. Measured on the UA-GEC verifier at 32 rows (2-core Xeon,
`bench/bench_batch_forward.py`): 0.89, 1.37 and 2.94 ms a row for 1, 3 and 11 tokens a row, so
cr ~ 0.66 ms and c1 ~ 0.21 ms. A line in T alone, fitted on plain AR traffic (T = rows), folds cr into
c1 and prices every draft token as a whole AR row: at 32 clients adaptive GAD then drafted 0.4
tokens a request and ran at 0.99x plain AR where fixed k = 10 ran at 1.15x; with the per-row term it
ran at 1.18x plain AR and 1.05x fixed k (`bench/bench_adaptive_load.py`, 5 rounds).

The drafter's fixed cost d0' is d0/rows, shared like the verifier's, when the drafter reports the
forwards its blocks ran in (its scheduler batches the blocks of every drafting request, and the
requests at one load choose alike: if drafting pays for this one it pays for the others, and they
fill the drafter's batch). It is charged whole, d0' = d0, when the drafter reports none (an
in-process drafter: its cost is learnt from the call's wall time, queueing included). Charging
d0/rows on wall times priced a lone draft as if the verifier's 32 rows shared it: after a spell at
one client (cheap drafter calls in the estimates), adaptive GAD at 32 clients drafted again and ran
at 0.88x plain AR. At rows = 1 the two charges are the same.

Why this ratio: when the rows of a batch behave alike, the server commits rows*E(k) tokens per
forward of c0 + rows*(cr + c1*(1+k)) (plus the drafter's), so the ratio is the server's throughput
over rows: maximising each request's share maximises the whole. (For unlike rows the exact optimum
of the batch's ratio, by Dinkelbach, has every row maximise E_i(k) - lambda*c1*(1+k) with lambda the
batch's throughput; the share ratio is that rule with lambda taken from the row itself, exact for
alike rows.) At rows = 1 it is the request's own tokens per second: when c0 dominates (latency-bound:
one request, a forward paying mostly per-call overhead) E grows faster than the cost and long blocks
win. At rows = 32 with c0/rows small, a draft pays only where its expected tokens beat what its c1
per token and the drafter's cost take from plain AR's cr + c1 a token: where the per-token cost
dominates (a compute-bound forward), the cost grows like 1 + k while E(k) < 1 + k for every a < 1,
and k = 0 wins. That is the fix for the usual complaint about vLLM / TensorRT-LLM speculation making
a loaded server slower than plain AR: a fixed k charges every request 1 + k tokens of a
compute-bound forward for E(k) tokens of progress.

The estimates
-------------
- a: per request, counts updated from every verified block: accepted draft tokens over draft
  positions reached (the accepted ones plus the first rejected one, if any), the maximum-likelihood
  rate of the geometric model E(k) assumes. The prior is the pooled rate of the mode over recent
  blocks of every request of this gateway, worth PRIOR_WEIGHT positions (empirical Bayes: a new
  request starts from what the traffic shows, not from a guess).
- c0, cr, c1: one `CostEstimator` per verifier (one per gateway process: the gateway's
  per-request verifier objects name the peer they share as their `load_key`), shared by its
  requests and thread-safe, fed with every step's (batch_rows, batch_tokens, forward_s) as the
  verifier's batching scheduler reports them; where a backend reports none (batch_tokens = 0), one
  row, the step's own tokens and the wall time of the verifier call (the loop calls the verifier
  between `propose` and `accept`, so that is what the gap between them times). Observations are kept
  per bucket (power of two of the rows, power of two of the tokens; the last BUCKET_SIZE of each,
  summarised by their mean without stalls) and the plane is a non-negative least-squares fit through
  the buckets: steady traffic at one load cannot wash out what other loads taught, and one slow
  outlier (a first call warming up) cannot swing the fit. Plain AR traffic alone (one token a row)
  cannot tell cr from c1, nor one client's (one row) c0 from cr: what the buckets cannot tell apart
  is split as the last traffic that could split it (`CostEstimator.memory`, kept when that
  traffic's observations expire; `fit_cost`).
- d0, dr, d1: the same estimator over the drafter's forwards, one per mode: (batch_rows,
  batch_tokens, forward_s) as the drafter's scheduler reports them with each block, queueing and the
  round trip left out. A drafter that reports none is timed by the call's wall time as one row of
  1 + k tokens, and a request's first draft is then not a sample: it opens the request's drafter
  session (a stream, an encoder run) and catches the drafter up on the output so far, a cost of the
  request paid once. Measured: at a cold start of 32 clients every request drafts (nothing is known
  yet), the first drafts queue behind each other's openings on the drafter, ~125 ms each, and with
  them as samples the drafter looked too dear to draft even at one client until they expired
  (MAX_AGE_S).
- rows: the requests decoding on this verifier now (every mode: `decode` counts them in and out),
  or the rows of the request's last forward when that is more (other gateways share the
  verifier). Not the last forward's rows alone: requests that draft spend half their time in the
  drafter, so their verifier forwards hold half of them; rows read from there make the load look
  lighter the more the requests draft, and drafting then pays for itself on paper however loaded
  the server (measured: 32 clients gave forwards of 2-3 rows and adaptive GAD stayed at long blocks).

Probing: while k = 0 wins, nothing is learnt about acceptance, and the drafter's cost is not
measured again. So after PROBE_AFTER plain AR steps of a mode in a row (counted over the gateway's
requests) one step drafts a short block (PROBE_K tokens), the interval doubling after each probe up
to PROBE_MAX_INTERVAL per ROWS_PER_RUN requests in flight: the estimates keep tracking at a bounded
cost. Under load the interval grows with the load, as the AR runs do: a probe costs more than its
PROBE_K tokens (the request's drafter session is opened for it: an encoder run on the drafter), and
at 32 clients, probing every 64 steps cost adaptive GAD ~7% of its throughput against plain AR.
Cost observations expire after MAX_AGE_S, so one that made drafting look too dear is not kept for
ever either; the first of each estimator is ignored (a backend's lazy start).

A probe is only made where what it could teach might change a choice: when the chooser, given an
acceptance rate of PROBE_CEILING (drafts as good as they get: on UA-GEC, a sentence with nothing to
correct), would draft at this load. Where even that loses to plain AR (a loaded, compute-bound
server), no acceptance a probe could reveal would make a request draft, and the probe is pure cost:
measured at 32 clients, 93 probes over 600 requests, each opening a drafter session and breaking
its request's AR run in two. The schedule resumes where it was when the load falls, its interval
cut at once to the new load's cap (a burst's long interval would otherwise hold back the probes that
tell a light load that drafting pays again).
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from core.interfaces import Draft, VerifyResult, load_key_of
from gateway.decoding_config import DecodingConfig
from gateway.policies.forward_cost import FREE, Cost, CostEstimator
from gateway.policies.loop import Accept, Propose

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
# winning (measured at 32 clients: runs of 8 left adaptive GAD at 0.80x plain AR's tokens/s, runs
# of 64 at 0.93-1.01x). Where no acceptance rate would make drafting pay at this load (a "hopeless"
# k = 0, `AdaptiveBlocks.propose`), the run goes to the end of the output instead.
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
            # forwards (measured at 32 clients, k = 0 forced: runs of AR_RUN per ROWS_PER_RUN rows
            # 0.93x plain AR's tokens/s, runs to the end 0.99x).
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
