"""Overlapped drafting in-process (decoding.policies.overlap), on the tiny float64 models.

The overlapped loop equals the plain loop token for token, step for step, for GAD, GAD++ and MJSD,
fixed and adaptive; a used pre-draft is exactly one drafter call fewer on the decode thread; the
drafter session never has two calls at once and none when it closes, whether the decode ends, the
verifier fails, or the drafter dies during a pre-draft (which then reaches the caller as the plain
loop's `DrafterFailure` would, and AR from the committed prefix completes the greedy output).
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.policies.adaptive import LoadModel
from decoding.policies.loop import DecodeResult
from decoding.policies.overlap import PREDRAFT_THREADS
from gateway.wire import stats_from_wire, stats_to_wire
from tests.property import examples
from tests.recording import (
    Record,
    RecordingDrafter,
    assert_a_drafter_death_fails_over_to_ar,
    assert_a_verifier_failure_waits_for_the_pool_call,
    assert_same_decode,
    block_mode_configs,
    local_drafter,
    local_verifier,
)
from tests.zoo import MAX_LEN, model_pool, random_source
from tests.zoo import sources as zoo_sources
from verifier_service.session import LocalVerifier

PROPERTY = settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])

def _configs() -> st.SearchStrategy[dict]:
    mjsd = st.fixed_dictionaries({
        "mode": st.just(Mode.MJSD), "gamma": st.integers(1, 6), "num_beams": st.integers(1, 4),
        "threshold": st.sampled_from([0.01, 0.1, 0.5, 1.0]),
    })
    return st.one_of(block_mode_configs(), mjsd)


def _pair(trio: int, source: list[int], **params) -> tuple[DecodeResult, DecodeResult, Record, Record]:
    """The plain loop's and the overlapped loop's results, and what each did to its drafter session."""
    runs, records = [], []
    for overlap in (False, True):
        recording = RecordingDrafter(local_drafter(trio))
        config = DecodingConfig(overlap=overlap, preverify=False, **params)
        runs.append(decode(source, config, local_verifier(trio), recording))
        records.extend(recording.records)
    return runs[0], runs[1], records[0], records[1]


@PROPERTY
@given(trio=st.integers(0, 3), source=zoo_sources(), max_new=st.integers(1, MAX_LEN - 1), params=_configs())
def test_overlapped_loop_equals_the_plain_loop(trio, source, max_new, params):
    plain, overlapped, plain_record, record = _pair(trio, source, max_new_tokens=max_new, **params)
    assert_same_decode(plain, overlapped)
    record.assert_clean()
    s = overlapped.stats
    assert 0 <= s.predrafts_used <= s.predrafts <= s.iterations
    # A pre-draft is a guess and its draft: at most two calls each, on the pool's threads.
    assert len(record.on_predraft_thread()) <= 2 * s.predrafts
    # Every used pre-draft is a drafter call the decode thread did not make, with the same arguments
    # as the plain loop's (the session's state then is the same output: the same draft).
    assert not plain_record.on_predraft_thread()
    assert len(record.on_decode_thread()) + s.predrafts_used == len(plain_record.calls)


@PROPERTY
@given(trio=st.integers(0, 3), source=zoo_sources(), max_new=st.integers(1, MAX_LEN - 1), k=st.integers(1, 16),
       mode=st.sampled_from([Mode.GAD, Mode.GAD_PLUS_PLUS]), seed=st.integers(0, 2**32 - 1))
def test_adaptive_overlapped_loop_equals_the_adaptive_plain_loop(trio, source, max_new, k, mode, seed):
    """Adaptive speculation with the same (random, seeded) block lengths: equal outputs and steps."""
    results = []
    for overlap in (False, True):
        verifier = LocalVerifier(model_pool()[trio].verifier)
        config = DecodingConfig(mode=mode, k=k, max_new_tokens=max_new, adaptive=True, overlap=overlap, preverify=False)
        recording = RecordingDrafter(local_drafter(trio))
        result = decode(source, config, verifier, recording, load=_Lengths(seed))
        results.append(result)
        # An adaptive request opens its drafter session on its first draft (none: never opened).
        assert len(recording.records) == (1 if result.stats.drafted_tokens or result.stats.predrafts else 0)
        for record in recording.records:
            record.assert_clean()
    assert_same_decode(*results)


class _Lengths(LoadModel):
    """Block lengths from a seeded stream, mostly the same length again (so pre-drafts can hit)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.last = 0

    def choose(self, mode: str, a: float, k_max: int, rows: int) -> int:
        if self.rng.random() < 0.3:
            self.last = self.rng.randint(0, k_max)
        return min(self.last or k_max, k_max)


def test_trained_models_use_many_pre_drafts_with_gad() -> None:
    """On the well-trained trio GAD accepts most blocks in full and the drafter's guess of the
    verifier's token is mostly right: pre-drafts are used, and each saves a drafter call."""
    gen = torch.Generator().manual_seed(5)
    used = made = calls = 0
    for _ in range(20):
        source = random_source(gen, 24)
        plain, overlapped, _, record = _pair(0, source, mode=Mode.GAD, k=4, max_new_tokens=60)
        assert_same_decode(plain, overlapped)
        record.assert_clean()
        used += overlapped.stats.predrafts_used
        made += overlapped.stats.predrafts
        calls += len(record.on_predraft_thread())
    assert made > 0 and used / made > 0.3, (used, made)  # 55 of 112 when written
    # GAD's blocks carry their guess (`Draft.lookahead`): a pre-draft is one call at most (none when
    # cancelled before it started, or answered from the sync's memory), two only after a block that
    # reached max_new_tokens' room (none here: the outputs end well before it).
    assert 0 < calls <= made


def test_the_first_draft_wait_is_kept_apart_from_the_later_ones_and_reaches_the_wire() -> None:
    """Overlap cannot hide a request's first draft (the bench's ceilings leave it out): its wait is
    `first_draft_time_s`, part of `drafter_time_s`, on the wire as `first_draft_ms`."""
    slow = 0.2

    def first_is_slow(call, record) -> None:
        if len(record.calls) == 1:
            time.sleep(slow)

    source = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 3
    for overlap in (False, True):
        recording = RecordingDrafter(local_drafter(0), first_is_slow)
        config = DecodingConfig(mode=Mode.GAD, k=3, max_new_tokens=60, overlap=overlap, preverify=False)
        stats = decode(source, config, local_verifier(0), recording).stats
        assert stats.iterations > 3 and len(recording.records[0].calls) > 3
        assert slow <= stats.first_draft_time_s < slow + 0.1
        assert 0 < stats.drafter_time_s - stats.first_draft_time_s < slow  # the later drafts: fast
        wire = stats_to_wire(stats, Mode.GAD, total_s=1.0)
        assert wire.first_draft_ms == pytest.approx(1e3 * stats.first_draft_time_s)
        assert stats_from_wire(wire, stats.output_tokens).first_draft_time_s == pytest.approx(stats.first_draft_time_s)


def test_speculative_sampling_and_drafterless_modes_never_pre_draft() -> None:
    source = [5, 6, 7, 8, 9, 10, 11, 12]
    for mode in (Mode.SPECULATIVE, Mode.IAD, Mode.AR):
        recording = RecordingDrafter(local_drafter(0))
        config = DecodingConfig(mode=mode, max_new_tokens=30, overlap=True, preverify=False)
        result = decode(source, config, local_verifier(0), recording)
        assert result.stats.predrafts == 0
        assert not any(c.predraft for r in recording.records for c in r.calls)


# --- failures while a pre-draft is in flight ----------------------------------------------------


def test_a_verifier_failure_waits_for_the_pre_draft_in_flight() -> None:
    source = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 3
    config = DecodingConfig(mode=Mode.GAD, k=3, max_new_tokens=60, overlap=True, preverify=False)
    assert_a_verifier_failure_waits_for_the_pool_call(
        source, config, local_verifier(0), local_drafter(0), fails=lambda lengths: len(lengths) == 3
    )


def test_a_drafter_that_dies_during_a_pre_draft_fails_like_a_plain_draft_and_ar_completes_it() -> None:
    source = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 3
    config = DecodingConfig(mode=Mode.GAD, k=3, max_new_tokens=60, overlap=True, preverify=False)
    assert_a_drafter_death_fails_over_to_ar(source, config, local_verifier(0), local_drafter(0))


def test_pre_draft_threads_are_a_bounded_pool_not_one_per_step() -> None:
    source = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 3
    for _ in range(5):
        config = DecodingConfig(mode=Mode.GAD, k=2, max_new_tokens=60, overlap=True, preverify=False)
        decode(source, config, local_verifier(0), local_drafter(0))
    names = [t.name for t in threading.enumerate() if t.name.startswith("specdec-predraft")]
    assert 1 <= len(names) <= PREDRAFT_THREADS
