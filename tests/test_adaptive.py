"""Speculation that adapts to load (decoding/policies/adaptive.py).

The chooser picks long blocks when a forward's fixed cost dominates and the drafts are good, and
plain AR steps when the batch is compute-bound and the drafts poor (the cost estimator itself:
tests/test_forward_cost.py); the policy learns from the forwards its answers report; and,
property-tested on the tiny models
(float64), adaptive IAD / GAD / GAD++ (beta 1) give exactly AR greedy's tokens whatever block
lengths run: the learned policy, forced extreme cost models (always AR, always k_max) and random
k sequences.
"""

from __future__ import annotations

import argparse
import functools
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.interfaces import Draft, VerifyResult
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.policies import adaptive
from decoding.policies.accept import exact
from decoding.policies.adaptive import (
    PROBE_AFTER,
    PROBE_CEILING,
    PROBE_K,
    PROBE_MAX_INTERVAL,
    AdaptiveBlocks,
    LoadModel,
    choose_block_length,
    expected_tokens,
    load_model,
    step_cost,
)
from decoding.policies.forward_cost import FREE, Cost
from decoding.policies.loop import DecodeStats
from drafter_service.session import LocalDrafter
from gateway.config import gateway_config
from gateway.wire import stats_from_wire, stats_to_wire
from specdec.commands.flags import add_decoding_flags, decoding_overrides
from tests.checks import RandomK
from tests.zoo import MAX_LEN, model_pool
from tests.zoo import sources as zoo_sources
from verifier_service.session import LocalVerifier

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MS = 1e-3

# --- the chooser ---------------------------------------------------------------------------------


def test_expected_tokens_is_the_geometric_sum() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.0, 10) == 1.0
    assert expected_tokens(1.0, 10) == 11.0


def test_high_acceptance_and_a_large_fixed_cost_pick_k_max() -> None:
    """One request, a forward that costs mostly its fixed part: the longest block wins."""
    verifier = Cost(c0=10 * MS, c1=0.1 * MS)
    drafter = Cost(c0=2 * MS, c1=0.05 * MS)
    assert choose_block_length(0.95, k_max=10, rows=1, verifier=verifier, drafter=drafter) == 10
    assert choose_block_length(0.95, k_max=25, rows=1, verifier=verifier, drafter=drafter) == 25


def test_low_acceptance_in_a_compute_bound_batch_picks_plain_ar() -> None:
    """32 rows, c0 small beside c1*T: every draft token costs nearly a whole AR step, so k = 0."""
    verifier = Cost(c0=2 * MS, c1=1 * MS)  # a 32-row AR forward: 34 ms, 94% of it per token
    drafter = Cost(c0=2 * MS, c1=0.2 * MS)
    assert choose_block_length(0.3, k_max=10, rows=32, verifier=verifier, drafter=drafter) == 0
    # Even perfect-ish drafts do not pay when the drafter is not free and tokens are all that cost.
    assert choose_block_length(0.9, k_max=10, rows=32, verifier=Cost(0.0, 1 * MS), drafter=drafter) == 0


def test_the_same_request_drafts_less_as_the_batch_fills() -> None:
    verifier, drafter = Cost(c0=20 * MS, c1=0.5 * MS), Cost(c0=3 * MS, c1=0.1 * MS)
    chosen = [choose_block_length(0.7, 10, rows, verifier, drafter) for rows in (1, 2, 4, 8, 16, 32, 64)]
    assert chosen == sorted(chosen, reverse=True)
    assert chosen[0] >= 6 and chosen[-1] == 0
    assert len(set(chosen)) >= 4  # it shortens step by step, not all or nothing


def test_a_draft_under_load_pays_the_drafters_whole_fixed_cost() -> None:
    """A drafter that reports no forwards (its cost learnt from wall times): under load most
    requests take k = 0, so the one that drafts has the drafter's forward to itself and its fixed
    cost is not shared by the verifier's rows. Drafting that pays at one request (and would at 32
    if d0 were split 32 ways) does not pay at 32."""
    verifier, drafter = Cost(c0=10 * MS, c1=0.1 * MS), Cost(c0=2 * MS, c1=0.1 * MS)
    assert step_cost(10, 32, verifier, drafter) == pytest.approx(10 * MS / 32 + 11 * 0.1 * MS + 2 * MS + 1.1 * MS)
    assert step_cost(0, 32, verifier, drafter) == pytest.approx(10 * MS / 32 + 0.1 * MS)
    assert choose_block_length(0.9, 10, 1, verifier, drafter) == 10
    assert choose_block_length(0.9, 10, 32, verifier, drafter) == 0
    shared = expected_tokens(0.9, 10) / step_cost(10, 32, verifier, drafter, drafter_shared=True)
    assert shared > 1 / step_cost(0, 32, verifier, drafter)  # what splitting d0 32 ways would have chosen


def test_free_drafts_and_free_tokens_pick_the_longest_block_and_no_acceptance_picks_none() -> None:
    assert choose_block_length(0.01, 7, 1, Cost(1 * MS, 0.0), FREE) == 7
    assert choose_block_length(0.0, 7, 1, Cost(1 * MS, 0.1 * MS), FREE) == 0
    assert choose_block_length(0.9, 0, 1, Cost(1 * MS, 0.0), FREE) == 0


# --- the per-request policy ------------------------------------------------------------------------


class _Fixed(LoadModel):
    """A load model whose verifier and drafter costs are given, not learned."""

    def __init__(self, verifier: Cost, drafter: Cost) -> None:
        super().__init__()
        self.lines = (verifier, drafter)

    def choose(self, mode: str, a: float, k_max: int, rows: int) -> int:
        return choose_block_length(a, k_max, rows, *self.lines)


class _PaysAbove(LoadModel):
    """Drafting pays for acceptance rates of at least `rate` and at most `max_rows` rows of load."""

    def __init__(self, rate: float, max_rows: int = 1 << 30) -> None:
        super().__init__()
        self.rate, self.max_rows = rate, max_rows

    def choose(self, mode: str, a: float, k_max: int, rows: int) -> int:
        return k_max if a >= self.rate and rows <= self.max_rows else 0


class _KMax(LoadModel):
    """Always the longest block (a cost model would tie once a^k underflows; this cannot)."""

    def choose(self, mode: str, a: float, k_max: int, rows: int) -> int:
        return k_max


class _Loop:
    """The draft-verify loop's calls into a policy, against given verifier answers (the policy's
    own bookkeeping only; the real loop runs in the lossless tests below)."""

    def __init__(self, blocks: AdaptiveBlocks) -> None:
        self.blocks = blocks
        self.out: list[int] = []

    def step(self, verifier_top1: list[int], **batch) -> tuple[int, int]:
        draft = self.blocks.propose(self.out, 100)
        ids = draft.ids
        res = VerifyResult(top1=verifier_top1[: len(ids) + 1], topk_ids=[], topk_logprobs=[], draft_logprobs=[],
                           **batch)
        accepted, token = self.blocks.accept(ids, draft, res)
        self.out += [*ids[:accepted], token]
        return accepted, token


def test_the_policy_learns_the_batch_from_the_verifiers_answer() -> None:
    load = LoadModel()
    calls: list[int] = []

    def propose(output: list[int], room: int, k: int) -> Draft:
        calls.append(k)
        return Draft(ids=[7] * k)

    load.verifier_cost.observe(1, 1, 9.0)  # an estimator's first observation (a lazy start) is ignored
    blocks = AdaptiveBlocks(load, "gad", 6, propose, exact)
    loop = _Loop(blocks)
    assert loop.step([7] * 7, batch_rows=32, batch_tokens=224, forward_s=0.05) == (6, 7)
    assert calls == [6]  # before any data the fixed cost is all there is: the longest block
    assert blocks.rows == 32
    assert load.verifier_cost.cost() == Cost(pytest.approx(0.05), 0.0)  # the batch's forward, not this step's wall time
    assert blocks.rate > adaptive.DEFAULT_RATE  # 6 of 6 accepted
    # A default result (a backend without the scheduler): the step's own tokens and wall time.
    assert loop.step([7, 7, 8, 0, 0, 0, 0]) == (2, 8)
    assert blocks.rows == 1
    # This step fed the verifier 1 + 6 tokens: the verifier's last token, then the draft.
    assert [o[:2] for obs in load.verifier_cost._buckets.values() for o in obs] == [(32.0, 224.0), (1.0, 7.0)]


def test_plain_ar_steps_call_no_drafter_and_the_gateway_probes_with_a_growing_interval() -> None:
    load = _PaysAbove(0.9)  # plain AR at the rates this request shows, drafting for drafts that good
    calls: list[int] = []

    def propose(output: list[int], room: int, k: int) -> Draft:
        calls.append(k)
        return Draft(ids=[9] * k)

    blocks = AdaptiveBlocks(load, "gad", 10, propose, exact)
    loop = _Loop(blocks)
    for _ in range(300):
        loop.step([8] * 11)
    probes = [i for i, k in enumerate(blocks.chosen) if k]
    assert all(blocks.chosen[i] == PROBE_K for i in probes) and calls == [PROBE_K] * len(probes)
    gaps = [b - a for a, b in zip([-1, *probes], probes, strict=False)]
    expected, interval = [], PROBE_AFTER
    while len(expected) < len(gaps):
        expected.append(interval)
        interval = min(2 * interval, PROBE_MAX_INTERVAL)
    assert gaps == expected
    # The schedule is the gateway's: a new request does not start it again.
    again = AdaptiveBlocks(load, "gad", 10, propose, exact)
    loop = _Loop(again)
    for _ in range(PROBE_MAX_INTERVAL):
        loop.step([8] * 11)
    assert [i for i, k in enumerate(again.chosen) if k] == [probes[-1] + PROBE_MAX_INTERVAL - 300]
    # Every probe was rejected at its first token: one position reached, none accepted.
    weight = adaptive.PRIOR_WEIGHT
    assert blocks.rate == pytest.approx(adaptive.DEFAULT_RATE * weight / (len(probes) + weight))


def test_the_prior_of_a_new_request_is_the_pooled_rate_of_its_mode() -> None:
    load = LoadModel()
    assert load.prior_rate("gad") == adaptive.DEFAULT_RATE
    for _ in range(200):
        load.pool("gad", drafted=10, accepted=1)  # 1 accepted of 2 reached
    assert load.prior_rate("gad") == pytest.approx(0.5, abs=0.01)
    assert load.prior_rate("iad") == adaptive.DEFAULT_RATE


# --- losslessness on the tiny models -------------------------------------------------------------


@functools.cache
def _drafter(trio: int) -> LocalDrafter:
    return LocalDrafter(model_pool()[trio].drafter_models())


@functools.cache
def _verifier(trio: int, policy: str) -> LocalVerifier:
    """A verifier object per (trio, policy): the load model is per verifier, so the learned policy
    keeps learning across examples as a gateway's would."""
    return LocalVerifier(model_pool()[trio].verifier)


@functools.cache
def _load(trio: int, policy: str) -> LoadModel | None:
    """The load model a forced policy decodes with (None: the verifier's own, learned)."""
    if policy == "always-ar":
        return _Fixed(Cost(0.0, 1 * MS), Cost(1.0, 0.0))
    if policy == "always-k-max":
        return _KMax()
    return None


@functools.cache
def _greedy(trio: int, source: tuple[int, ...], max_new: int) -> list[int]:
    config = DecodingConfig(mode=Mode.AR, max_new_tokens=max_new)
    return decode(list(source), config, _verifier(trio, "greedy"), None).output_ids


LOSSLESS = [(Mode.IAD, {}), (Mode.GAD, {}), (Mode.GAD_PLUS_PLUS, {"beta": 1})]


def _adaptive_equals_greedy(trio, source, max_new, k, mode, extra, policy) -> DecodeStats:
    config = DecodingConfig(mode=mode, k=k, max_new_tokens=max_new, adaptive=True, **extra)
    result = decode(source, config, _verifier(trio, policy), _drafter(trio), load=_load(trio, policy))
    assert result.output_ids == _greedy(trio, tuple(source), max_new)
    stats = result.stats
    assert sum(stats.steps_per_draft_length) == stats.iterations
    assert len(stats.steps_per_draft_length) <= k + 1
    return stats


@PROPERTY
@given(trio=st.integers(0, 3), source=zoo_sources(), max_new=st.integers(1, MAX_LEN - 1), k=st.integers(1, 20),
       mode=st.sampled_from(range(len(LOSSLESS))))
def test_adaptive_modes_equal_greedy_with_the_learned_policy(trio, source, max_new, k, mode):
    _adaptive_equals_greedy(trio, source, max_new, k, *LOSSLESS[mode], "learned")


@PROPERTY
@given(trio=st.integers(0, 3), source=zoo_sources(), max_new=st.integers(1, MAX_LEN - 1), k=st.integers(1, 20),
       mode=st.sampled_from(range(len(LOSSLESS))))
def test_adaptive_modes_equal_greedy_when_forced_to_plain_ar(trio, source, max_new, k, mode):
    stats = _adaptive_equals_greedy(trio, source, max_new, k, *LOSSLESS[mode], "always-ar")
    drafted_steps = sum(stats.steps_per_draft_length[1:])
    # Drafting never pays there, not even for perfect drafts: no probe either.
    assert drafted_steps == 0


@PROPERTY
@given(trio=st.integers(0, 3), source=zoo_sources(), max_new=st.integers(1, MAX_LEN - 1), k=st.integers(1, 20))
def test_adaptive_gad_equals_greedy_when_forced_to_k_max(trio, source, max_new, k):
    stats = _adaptive_equals_greedy(trio, source, max_new, k, Mode.GAD, {}, "always-k-max")
    fixed = decode(source, DecodingConfig(mode=Mode.GAD, k=k, max_new_tokens=max_new), _verifier(trio, "fixed"),
                   _drafter(trio)).stats
    assert stats.steps_per_draft_length == fixed.steps_per_draft_length  # the same blocks as fixed k


@PROPERTY
@given(trio=st.integers(0, 3), source=zoo_sources(), max_new=st.integers(1, MAX_LEN - 1), k=st.integers(1, 20),
       mode=st.sampled_from(range(len(LOSSLESS))), seed=st.integers(0, 2**32 - 1))
def test_adaptive_modes_equal_greedy_with_random_block_lengths(trio, source, max_new, k, mode, seed):
    verifier = LocalVerifier(model_pool()[trio].verifier)
    mode_, extra = LOSSLESS[mode]
    config = DecodingConfig(mode=mode_, k=k, max_new_tokens=max_new, adaptive=True, **extra)
    # Block lengths at random: a request's choices in any order, any k in 0..k_max.
    result = decode(source, config, verifier, _drafter(trio), load=RandomK(seed))
    assert result.output_ids == _greedy(trio, tuple(source), max_new)


def test_a_requests_first_draft_is_not_a_sample_of_the_drafters_cost() -> None:
    """The first draft's wall time includes opening the request's drafter session (an encoder run,
    a stream): a cost of the request, not of a draft. Every later draft is a sample."""
    load = _KMax()
    samples: list[tuple] = []
    load.drafter_cost("gad").observe = lambda rows, tokens, seconds: samples.append((rows, tokens))
    for _ in range(2):  # two requests, three drafts of 4 each
        loop = _Loop(AdaptiveBlocks(load, "gad", 4, lambda output, room, k: Draft(ids=[7] * k), exact))
        for _ in range(3):
            loop.step([7] * 5)
    assert samples == [(1, 5)] * 4  # one row: the verifier's token and 4 masks


def test_a_drafter_that_reports_its_forwards_is_learnt_from_them_and_its_fixed_cost_shared() -> None:
    """A drafter service reports the forward each block ran in (rows, tokens, seconds), its
    queueing and round trip left out: every draft is a sample, the first too (the session's opening
    is not in the forward), and its fixed cost is shared by the load's rows like the verifier's."""
    load = _KMax()
    drafts = iter([Draft(ids=[7] * 4, batch_rows=rows, batch_tokens=5 * rows, forward_s=(3 + rows) * MS)
                   for rows in (8, 1, 16, 32)])
    loop = _Loop(AdaptiveBlocks(load, "gad", 4, lambda output, room, k: next(drafts), exact))
    for _ in range(4):
        loop.step([7] * 5)
    est = load.drafter_cost("gad")
    assert [o[:2] for obs in est._buckets.values() for o in obs] == [(1.0, 5.0), (16.0, 80.0), (32.0, 160.0)]
    verifier = Cost(c0=5 * MS, c1=0.2 * MS, cr=0.7 * MS)
    drafter = Cost(c0=3 * MS, c1=0.1 * MS, cr=0.2 * MS)
    assert step_cost(4, 32, verifier, drafter, drafter_shared=True) == pytest.approx(
        5 * MS / 32 + 0.7 * MS + 5 * 0.2 * MS + 3 * MS / 32 + 0.2 * MS + 5 * 0.1 * MS)
    learned = LoadModel()
    learned.verifier_cost.cost = lambda: verifier
    learned.drafter_cost("gad").cost = lambda: drafter
    assert learned.choose("gad", 0.8, 10, 32) == 0  # its drafter not heard from yet: d0 charged whole
    learned.observe_draft("gad", 4, Draft(ids=[7] * 4, batch_rows=2, batch_tokens=10, forward_s=4 * MS), 0.1, True)
    assert learned.choose("gad", 0.8, 10, 32) == choose_block_length(0.8, 10, 32, verifier, drafter, True) > 0


def test_the_learned_policy_learns_from_a_decode() -> None:
    verifier = LocalVerifier(model_pool()[0].verifier)
    config = DecodingConfig(mode=Mode.GAD, k=8, max_new_tokens=40, adaptive=True)
    drafted = 0
    for source in ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [9, 8, 7, 6, 5], [4, 4, 5, 5, 6, 6]):
        drafted += decode(source, config, verifier, _drafter(0)).stats.drafted_tokens
    load = load_model(verifier)
    assert load.verifier_cost._buckets and load.drafter_cost("gad")._buckets
    assert drafted > 0 and load.prior_rate("gad") != adaptive.DEFAULT_RATE


# --- config, flags, wire ---------------------------------------------------------------------------


def test_adaptive_is_off_by_default_and_set_by_defaults_flags_and_wire() -> None:
    assert DecodingConfig().adaptive is False
    assert gateway_config({"defaults": {"adaptive": True}}).defaults.adaptive is True
    with pytest.raises(ValueError, match="adaptive"):
        gateway_config({"defaults": {"adaptive": 1}})
    parser = argparse.ArgumentParser()
    add_decoding_flags(parser)
    assert decoding_overrides(parser.parse_args(["--adaptive"]))["adaptive"] is True
    assert decoding_overrides(parser.parse_args(["--no-adaptive"]))["adaptive"] is False
    assert decoding_overrides(parser.parse_args([]))["adaptive"] is None


def test_steps_per_draft_length_reach_the_wire() -> None:
    stats = DecodeStats()
    for drafted, accepted in ((0, 0), (3, 1), (3, 3), (0, 0), (1, 0)):
        stats.iterations += 1
        stats.record_accepts(drafted, accepted)
    assert stats.steps_per_draft_length == [2, 1, 0, 2]
    assert stats.mean_draft_length == pytest.approx(7 / 5)
    wire = stats_to_wire(stats, Mode.GAD, 0.1)
    assert list(wire.steps_per_draft_length) == [2, 1, 0, 2]
    assert stats_from_wire(wire, 0).steps_per_draft_length == [2, 1, 0, 2]


# --- what the load is learnt per, and read from --------------------------------------------------


def test_the_gateways_per_request_verifiers_share_one_load_model() -> None:
    """The gateway makes a RemoteVerifier per request; what adaptive speculation learns (costs,
    pooled acceptance) is kept per channel they share, not thrown away with each request."""
    import grpc

    from gateway.peers.remote import RemoteVerifier
    from protos.specdec.v1 import common_pb2

    info = common_pb2.ModelInfo(vocab_size=32, bos_id=1, eos_id=2)
    shared, other = grpc.insecure_channel("127.0.0.1:9"), grpc.insecure_channel("127.0.0.1:9")
    try:
        first, second = RemoteVerifier(shared, info), RemoteVerifier(shared, info)
        assert load_model(first) is load_model(second)
        assert load_model(RemoteVerifier(other, info)) is not load_model(first)
    finally:
        shared.close()
        other.close()


class _InFlight(LoadModel):
    """Records the requests in flight at every choice; the first choice of each request waits
    until `parties` requests have made theirs (so all of them are decoding then)."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(parties, timeout=30)
        self.seen: list[int] = []
        self.rows: list[int] = []
        self._first: set[int] = set()

    def choose(self, mode: str, a: float, k_max: int, rows: int) -> int:
        if threading.get_ident() not in self._first:
            self._first.add(threading.get_ident())
            self.barrier.wait()
            self.seen.append(self.in_flight)
        self.rows.append(rows)
        return k_max


def test_every_request_decoding_on_a_verifier_counts_in_its_load() -> None:
    verifier = LocalVerifier(model_pool()[1].verifier)
    load = _InFlight(parties=3)
    config = DecodingConfig(mode=Mode.GAD, k=4, max_new_tokens=MAX_LEN - 1, adaptive=True)
    sources = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15]]
    outputs: list[list[int]] = []
    threads = [threading.Thread(
        target=lambda s=s: outputs.append(decode(s, config, verifier, _drafter(1), load=load).output_ids)
    ) for s in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(outputs) == 3 and load.seen == [3, 3, 3] and load.in_flight == 0
    ar = DecodingConfig(mode=Mode.AR, max_new_tokens=MAX_LEN - 1)
    assert sorted(outputs) == sorted(decode(s, ar, verifier, None).output_ids for s in sources)


def test_a_choice_takes_the_requests_in_flight_as_its_rows() -> None:
    """Requests that draft leave the verifier's forwards half empty (their other half is in the
    drafter), so the load is read from the requests in flight when they are more than the last
    forward's rows; the rows when more (other gateways on the same verifier)."""
    load = _InFlight(parties=1)
    blocks = AdaptiveBlocks(load, "gad", 10, lambda output, room, k: Draft(ids=[7] * k), exact)
    loop = _Loop(blocks)
    with load.decoding(), load.decoding(), load.decoding():
        loop.step([7] * 11)
    assert load.rows == [3]
    blocks.rows = 5  # the last forward's rows
    with load.decoding():
        loop.step([7] * 11)
    assert load.rows == [3, 5]


def test_an_adaptive_request_that_never_drafts_never_opens_the_drafter() -> None:
    """k = 0 at every step (a loaded server): the drafter session, its stream and its encoder run
    are never paid for; output AR greedy's."""
    from tests.recording import RecordingDrafter

    verifier = LocalVerifier(model_pool()[0].verifier)
    never_pays = _Fixed(Cost(0.0, 1 * MS), Cost(1.0, 0.0))  # drafting never pays
    recording = RecordingDrafter(_drafter(0))
    source = [5, 6, 7, 8, 9]
    max_new = min(PROBE_AFTER - 1, MAX_LEN - 1)  # ends before the gateway's first probe is due
    result = decode(source, DecodingConfig(mode=Mode.GAD, k=6, max_new_tokens=max_new, adaptive=True),
                    verifier, recording, load=never_pays)
    assert result.stats.drafted_tokens == 0 and recording.records == []
    greedy = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=max_new), verifier)
    assert result.output_ids == greedy.output_ids
    # Once it drafts (a forced long block), the session opens on that first call and closes at the end.
    drafted = decode(source, DecodingConfig(mode=Mode.GAD, k=6, max_new_tokens=max_new, adaptive=True),
                     verifier, recording, load=_KMax())
    assert drafted.stats.drafted_tokens > 0 and len(recording.records) == 1 and recording.records[0].closed
    assert drafted.output_ids == result.output_ids


def test_under_load_a_plain_choice_runs_longer() -> None:
    """k = 0 where better drafts would pay runs AR_RUN steps per ROWS_PER_RUN requests in flight
    (fewer round trips while plain AR keeps winning), never past the room left."""
    from contextlib import ExitStack

    load = _PaysAbove(PROBE_CEILING)  # this request's prior rate (DEFAULT_RATE) is below it
    blocks = AdaptiveBlocks(load, "gad", 10, lambda output, room, k: Draft(ids=[7] * k), exact)
    assert blocks.rate < PROBE_CEILING
    assert blocks.propose([], 100).ar_steps == adaptive.AR_RUN
    blocks = AdaptiveBlocks(load, "gad", 10, lambda output, room, k: Draft(ids=[7] * k), exact)
    with ExitStack() as stack:
        for _ in range(32):
            stack.enter_context(load.decoding())
        assert blocks.propose([], 100).ar_steps == adaptive.AR_RUN * 32 // adaptive.ROWS_PER_RUN
        assert blocks.propose([], 20).ar_steps == 21  # the room left, and the step after it (EOS)
    assert set(blocks.chosen) == {0}


def test_where_no_draft_could_pay_a_plain_choice_runs_to_the_end() -> None:
    """k = 0 where even drafts as good as PROBE_CEILING would lose at this load: one run for all
    the room left and the step after it (EOS), at any load, and no probe."""
    from contextlib import ExitStack

    calls: list[int] = []
    never = _Fixed(Cost(0.0, 1 * MS), Cost(1.0, 0.0))  # a drafter call costs a second
    blocks = AdaptiveBlocks(never, "gad", 10, lambda output, room, k: calls.append(k) or Draft(ids=[7] * k), exact)
    assert blocks.propose([], 100).ar_steps == 101
    with ExitStack() as stack:
        for _ in range(32):
            stack.enter_context(never.decoding())
        assert blocks.propose([], 500).ar_steps == 501
    light = _PaysAbove(PROBE_CEILING, max_rows=4)  # good drafts pay at up to 4 rows
    blocks = AdaptiveBlocks(light, "gad", 10, lambda output, room, k: calls.append(k) or Draft(ids=[7] * k), exact)
    with ExitStack() as stack:
        for _ in range(8):
            stack.enter_context(light.decoding())
        assert blocks.propose([], 100).ar_steps == 101
    assert blocks.propose([], 100).ar_steps == adaptive.AR_RUN  # 1 row: better drafts would pay
    assert calls == []


def test_no_probe_where_even_the_best_drafts_would_not_pay() -> None:
    """A probe only learns the acceptance rate; where drafts as good as PROBE_CEILING would still
    lose to plain AR at this load, it is not made (no drafter call at all), and the gateway's
    schedule goes on where it was once the load falls."""
    from contextlib import ExitStack

    calls: list[int] = []

    def propose(output: list[int], room: int, k: int) -> Draft:
        calls.append(k)
        return Draft(ids=[9] * k)

    never = _Fixed(Cost(0.0, 1 * MS), Cost(1.0, 0.0))  # a drafter call costs a second
    loop = _Loop(AdaptiveBlocks(never, "gad", 10, propose, exact))
    for _ in range(10 * PROBE_AFTER):
        loop.step([8] * 11)
    assert calls == [] and set(loop.blocks.chosen) == {0}

    light = _PaysAbove(PROBE_CEILING, max_rows=4)  # perfect-ish drafts pay up to 4 rows of load
    loop = _Loop(AdaptiveBlocks(light, "gad", 10, propose, exact))
    with ExitStack() as stack:
        for _ in range(8):
            stack.enter_context(light.decoding())
        for _ in range(10 * PROBE_AFTER):
            loop.step([8] * 11)
        assert calls == []
    for _ in range(PROBE_AFTER):  # 1 row: a probe is due after PROBE_AFTER plain steps
        loop.step([8] * 11)
    assert calls == [PROBE_K] and loop.blocks.chosen[-1] == PROBE_K


def test_under_load_probes_come_further_apart() -> None:
    """The probe interval doubles up to PROBE_MAX_INTERVAL per ROWS_PER_RUN requests in flight."""

    def gaps(rows: int) -> list[int]:
        load, found, since = LoadModel(), [], 0
        for _ in range(20 * PROBE_MAX_INTERVAL):
            since += 1
            if load.probe("gad", drafting=False, rows=rows):
                found.append(since)
                since = 0
        return found

    assert max(gaps(1)) == PROBE_MAX_INTERVAL
    assert max(gaps(32)) == PROBE_MAX_INTERVAL * 32 // adaptive.ROWS_PER_RUN
    assert gaps(32)[:4] == gaps(1)[:4] == [PROBE_AFTER, 2 * PROBE_AFTER, 4 * PROBE_AFTER, 8 * PROBE_AFTER]


def test_when_the_load_falls_the_next_probe_comes_within_the_light_loads_interval() -> None:
    """After a burst has stretched the probe interval, one client gets its probe within
    PROBE_MAX_INTERVAL plain steps, not after the burst's interval (8x that at 32 requests)."""
    load = LoadModel()
    while True:  # 32 requests in flight until the interval has grown past one client's cap
        load.probe("gad", drafting=False, rows=32)
        if load._probes["gad"][1] > 2 * PROBE_MAX_INTERVAL:
            break
    steps = 1
    while not load.probe("gad", drafting=False, rows=1):
        steps += 1
    assert steps <= PROBE_MAX_INTERVAL
    since, gaps = 0, []  # and from there on, one client's schedule
    for _ in range(4 * PROBE_MAX_INTERVAL):
        since += 1
        if load.probe("gad", drafting=False, rows=1):
            gaps.append(since)
            since = 0
    assert gaps and max(gaps) == PROBE_MAX_INTERVAL
