"""What a forward costs, learnt online (decoding/policies/forward_cost.py): the estimator recovers
c0, cr and c1 from noisy observations, keeps how a forward's cost divides when the traffic cannot
tell (plain AR traffic, one client), follows a change of load, and shrugs off an outlier."""

from __future__ import annotations

import random
import threading

import pytest

from decoding.policies import forward_cost
from decoding.policies.adaptive import choose_block_length
from decoding.policies.forward_cost import FREE, Cost, CostEstimator, fit_cost, fit_line

MS = 1e-3


def test_the_estimator_recovers_c0_cr_and_c1_from_noisy_observations() -> None:
    rng = random.Random(0)
    est = CostEstimator()
    truth = Cost(c0=4 * MS, c1=0.25 * MS, cr=0.6 * MS)
    for _ in range(2000):
        rows = rng.randint(1, 32)
        tokens = rows * rng.choice((1, 1, 3, 11))  # plain AR rows, probes, long blocks
        est.observe(rows, tokens, truth(rows, tokens) * rng.uniform(0.9, 1.1))
    cost = est.cost()
    assert cost.c0 == pytest.approx(truth.c0, rel=0.15)
    assert cost.cr == pytest.approx(truth.cr, rel=0.1)
    assert cost.c1 == pytest.approx(truth.c1, rel=0.05)
    assert est.memory == cost


def test_plain_ar_traffic_keeps_the_per_row_split_an_earlier_mix_taught() -> None:
    """A verifier under plain AR traffic feeds one token a row: its forwards cannot tell a row's
    cost from a token's. Folding both into c1 priced every draft token as a whole AR row (measured
    at 32 clients: adaptive GAD drafted 0.4 tokens a request where fixed k = 10 beat plain AR by
    15%). The split of the last mixed traffic is kept; before any, all of it is per token. Likewise
    one client's forwards (one row each) cannot tell c0 from cr."""
    truth = Cost(c0=5 * MS, c1=0.2 * MS, cr=0.7 * MS)
    now = [0.0]
    est = CostEstimator(clock=lambda: now[0])
    ar_only = CostEstimator()
    for rows in (1, 2, 4, 8, 16, 32):
        ar_only.observe(rows, rows, truth(rows, rows))
        ar_only.observe(rows, rows, truth(rows, rows))
    assert ar_only.cost() == Cost(pytest.approx(5 * MS), pytest.approx(0.9 * MS), 0.0)
    for rows in (1, 2, 4, 8, 16, 32):  # drafting traffic first: 1, 3 and 11 tokens a row
        for per_row in (1, 3, 11):
            est.observe(rows, rows * per_row, truth(rows, rows * per_row))
    assert est.cost() == Cost(pytest.approx(5 * MS), pytest.approx(0.2 * MS), pytest.approx(0.7 * MS))
    now[0] = forward_cost.MAX_AGE_S + 1  # that traffic expires; plain AR steps only from here
    for rows in (1, 2, 4, 8, 16, 32):
        est.observe(rows, rows, truth(rows, rows))
    assert est.cost() == Cost(pytest.approx(5 * MS), pytest.approx(0.2 * MS), pytest.approx(0.7 * MS))
    now[0] = 2 * forward_cost.MAX_AGE_S + 2  # then one client: one row a forward, 1 to 11 tokens
    for tokens in (1, 3, 11, 1, 3, 11):
        est.observe(1, tokens, truth(1, tokens))
    assert est.cost() == Cost(pytest.approx(5 * MS), pytest.approx(0.2 * MS), pytest.approx(0.7 * MS))
    now[0] = 3 * forward_cost.MAX_AGE_S + 3  # then one bucket only: the remembered shape, at its level
    for _ in range(3):
        est.observe(1, 11, 2 * truth(1, 11))
    assert est.cost() == Cost(pytest.approx(10 * MS), pytest.approx(0.4 * MS), pytest.approx(1.4 * MS))
    # What that changes: at 32 rows and acceptance 0.8, a reporting drafter's blocks pay.
    drafter = Cost(c0=3 * MS, c1=0.1 * MS, cr=0.2 * MS)
    assert choose_block_length(0.8, 10, 32, est.cost(), drafter, drafter_shared=True) >= 3
    assert choose_block_length(0.8, 10, 32, ar_only.cost(), drafter, drafter_shared=True) == 0


def test_after_a_change_of_load_the_buckets_it_observes_decide_the_fit() -> None:
    """Forwards timed while drafter and verifier share the host's cores take longer: after a spell
    of 32-row drafter forwards at ~8 ms a row, one client's one-row drafts take 2 ms. Within a few
    seconds of the new load the fit prices a one-row draft near 2 ms, not at the old load's 8."""
    now = [0.0]
    est = CostEstimator(clock=lambda: now[0])
    for second in range(30):
        now[0] = second
        for rows in (2, 4, 8, 16, 32):
            est.observe(rows, 11 * rows, 8.4 * MS * rows)
    priced = []
    for second in range(31, 41):
        now[0] = second
        est.observe(1, 11, 2.0 * MS)
        est.observe(1, 6, 1.8 * MS)
        priced.append(est.cost()(1, 11))
    assert priced[0] < 3.5 * MS and priced[-1] == pytest.approx(2.0 * MS, rel=0.25)
    assert priced == sorted(priced, reverse=True)


def test_fit_cost_keeps_every_coefficient_non_negative() -> None:
    # A cost that falls with the rows: the best fit with cr = 0.
    points = [(1, 1, 2.0), (8, 8, 1.5), (8, 88, 3.0), (32, 32, 1.0), (32, 352, 2.0)]
    cost = fit_cost(points)
    assert min(cost.c0, cost.cr, cost.c1) >= 0 and cost.cr == 0.0
    assert fit_cost([(1, 1, 1.0)]) == Cost(1.0, 0.0)
    one_row = [(1, 1, 2.0), (1, 3, 3.0), (1, 11, 7.0)]  # rows alike, nothing remembered: all fixed
    assert fit_cost(one_row) == Cost(pytest.approx(1.5), pytest.approx(0.5), 0.0)
    assert fit_cost(one_row, Cost(1.0, 0.5, 1.0)) == Cost(pytest.approx(0.75), pytest.approx(0.5), pytest.approx(0.75))


def test_one_outlier_does_not_swing_the_fit_and_new_loads_do_not_erase_old_ones() -> None:
    est = CostEstimator()
    for i in range(30):
        if i == 20:
            est.observe(1, 1, 5.0)  # a stall: 1000x the steady cost, still among the last observations
        for tokens in (1, 3, 11, 40, 100):
            est.observe(1, tokens, 2 * MS + 0.1 * MS * tokens)
    for _ in range(500):  # then steady traffic at one batch size only
        est.observe(1, 320, 2 * MS + 0.1 * MS * 320)
    line = est.cost()
    assert line.c0 == pytest.approx(2 * MS, rel=0.01)
    assert line.c1 == pytest.approx(0.1 * MS, rel=0.01)


def test_the_estimator_before_data_and_with_one_batch_size() -> None:
    assert CostEstimator().cost() == Cost(1.0, 0.0)
    assert CostEstimator(prior=FREE).cost() == FREE
    est = CostEstimator()
    for _ in range(5):
        est.observe(1, 1, 3 * MS)
    assert est.cost() == Cost(pytest.approx(3 * MS), 0.0)  # slope unknown: taken as 0 (drafting is tried)


def test_old_observations_are_forgotten() -> None:
    """A cost that made drafting look too dear cannot freeze the choice: it expires."""
    now = [0.0]
    est = CostEstimator(clock=lambda: now[0])
    est.observe(1, 1, 1 * MS)  # the warm-up observation
    est.observe(1, 10, 500 * MS)  # a dear block, once
    for _ in range(5):
        est.observe(1, 2, 1 * MS)
    assert est.cost()(1, 10) > 4 * MS
    now[0] = forward_cost.MAX_AGE_S / 2
    for _ in range(5):
        est.observe(1, 2, 1 * MS)
    assert est.cost()(1, 10) > 4 * MS
    now[0] = forward_cost.MAX_AGE_S + 1
    assert est.cost() == Cost(pytest.approx(1 * MS), 0.0)
    now[0] = 3 * forward_cost.MAX_AGE_S
    assert est.cost() == est.prior


def test_fit_line_keeps_both_coefficients_non_negative() -> None:
    assert fit_line([(1, 5.0), (10, 1.0)]) == Cost(3.0, 0.0)  # falling costs: a flat line at the mean
    line = fit_line([(10, 1.0), (20, 3.0)])  # would cross below zero at x = 0: through the origin
    assert line.c0 == 0.0 and line.c1 == pytest.approx(0.14)


def test_the_estimator_is_shared_safely_between_threads() -> None:
    est = CostEstimator()

    def feed(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(500):
            tokens = rng.randint(1, 64)
            est.observe(1, tokens, 1 * MS + 0.5 * MS * tokens)
            est.cost()

    threads = [threading.Thread(target=feed, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert est.cost().c0 == pytest.approx(1 * MS, rel=1e-6) and est.cost().c1 == pytest.approx(0.5 * MS, rel=1e-6)
