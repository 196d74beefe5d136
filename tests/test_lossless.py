"""Losslessness, property-tested on random tiny models and random sources (float64: no near-ties).

IAD and GAD equal AR greedy; GAD++ with beta=1 (or tau=0) equals GAD; MJSD with threshold 1
equals greedy; fixed beam width 1 equals greedy; variable-width beam without pruning equals
fixed width. Sources have length 1..64 and repeated tokens, so IAD's unique-match rule meets
both unique and ambiguous n-grams.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drafter_service.session import LocalDrafter
from gateway.decode import decode
from gateway.decoding_config import DecodingConfig, Mode
from tests.zoo import FIRST_WORD, MAX_LEN, VOCAB, model_pool, random_source
from verifier_service.session import LocalVerifier

EXAMPLES = 200
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

words = st.integers(FIRST_WORD, VOCAB - 1)
sources = st.one_of(
    st.lists(words, min_size=1, max_size=64),
    # A short pattern repeated: many n-grams occur more than once.
    st.builds(
        lambda pattern, times: (pattern * times)[:64], st.lists(words, min_size=1, max_size=6), st.integers(1, 20)
    ),
)
lengths = st.integers(1, MAX_LEN - 1)
trios = st.integers(0, 3)


def _run(trio_index: int, source: list[int], **overrides):
    trio = model_pool()[trio_index]
    verifier = LocalVerifier(trio.verifier)
    drafter = LocalDrafter(trio.drafter_models())
    return decode(source, DecodingConfig(**overrides), verifier, drafter)


@PROPERTY
@given(trio=trios, source=sources, max_new=lengths, k=st.integers(1, 40))
def test_iad_equals_greedy(trio, source, max_new, k):
    greedy = _run(trio, source, mode=Mode.AR, max_new_tokens=max_new)
    iad = _run(trio, source, mode=Mode.IAD, max_new_tokens=max_new, k=k)
    assert iad.output_ids == greedy.output_ids
    assert iad.stats.finish_reason == greedy.stats.finish_reason


@PROPERTY
@given(trio=trios, source=sources, max_new=lengths, k=st.integers(1, 25))
def test_gad_equals_greedy(trio, source, max_new, k):
    greedy = _run(trio, source, mode=Mode.AR, max_new_tokens=max_new)
    gad = _run(trio, source, mode=Mode.GAD, max_new_tokens=max_new, k=k)
    assert gad.output_ids == greedy.output_ids
    assert gad.stats.iterations <= greedy.stats.iterations


@PROPERTY
@given(
    trio=trios,
    source=sources,
    max_new=lengths,
    k=st.integers(1, 25),
    beta_tau=st.one_of(
        st.tuples(st.just(1), st.floats(0, 50, allow_nan=False)),
        st.tuples(st.integers(1, VOCAB), st.just(0.0)),
    ),
)
def test_gad_plus_plus_with_beta_1_or_tau_0_equals_gad(trio, source, max_new, k, beta_tau):
    beta, tau = beta_tau
    gad = _run(trio, source, mode=Mode.GAD, max_new_tokens=max_new, k=k)
    gadpp = _run(trio, source, mode=Mode.GAD_PLUS_PLUS, max_new_tokens=max_new, k=k, beta=beta, tau=tau)
    assert gadpp.output_ids == gad.output_ids


@PROPERTY
@given(trio=trios, source=sources, max_new=lengths, gamma=st.integers(1, 8), beams=st.integers(1, 6))
def test_mjsd_with_threshold_1_equals_greedy(trio, source, max_new, gamma, beams):
    greedy = _run(trio, source, mode=Mode.AR, max_new_tokens=max_new)
    mjsd = _run(trio, source, mode=Mode.MJSD, max_new_tokens=max_new, gamma=gamma, num_beams=beams, threshold=1.0)
    assert mjsd.output_ids == greedy.output_ids


@PROPERTY
@given(trio=trios, source=sources, max_new=lengths)
def test_beam_width_1_equals_greedy(trio, source, max_new):
    greedy = _run(trio, source, mode=Mode.AR, max_new_tokens=max_new)
    beam = _run(trio, source, mode=Mode.BEAM, max_new_tokens=max_new, num_beams=1)
    assert beam.output_ids == greedy.output_ids


@PROPERTY
@given(trio=trios, source=sources, max_new=st.integers(1, 40), width=st.integers(1, 5))
def test_variable_width_beam_without_pruning_equals_fixed_width(trio, source, max_new, width):
    fixed = _run(trio, source, mode=Mode.BEAM, max_new_tokens=max_new, num_beams=width)
    variable = _run(
        trio,
        source,
        mode=Mode.BEAM,
        max_new_tokens=max_new,
        num_beams=width,
        beam_delta=math.inf,
        beam_max_candidates=width,
    )
    assert variable.output_ids == fixed.output_ids


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    trio=trios,
    source=sources,
    max_new=st.integers(2, MAX_LEN - 1),
    cut=st.floats(0, 1),
    mode=st.sampled_from([Mode.AR, Mode.GAD]),
)
def test_continuing_a_committed_prefix_gives_the_same_output(trio, source, max_new, cut, mode):
    """The gateway's fallback continues from what is already committed: for a lossless mode the
    result is the same as decoding from scratch."""
    greedy = _run(trio, source, mode=Mode.AR, max_new_tokens=max_new)
    n = min(int(cut * len(greedy.output_ids)), max_new - 1)
    prefix = greedy.output_ids[:n]
    trio_models = model_pool()[trio]
    config = DecodingConfig(mode=mode, max_new_tokens=max_new, k=5)
    streamed: list[int] = []
    resumed = decode(
        source,
        config,
        LocalVerifier(trio_models.verifier),
        LocalDrafter(trio_models.drafter_models()),
        on_tokens=streamed.extend,
        prefix=prefix,
    )
    assert resumed.output_ids == greedy.output_ids
    assert prefix + streamed == greedy.output_ids


# ---- The properties above are only worth something if drafts are really accepted. ----


@pytest.mark.parametrize("mode", [Mode.IAD, Mode.GAD, Mode.MJSD])
def test_trained_tiny_models_accept_drafts(mode):
    """On the best-trained trio, drafts are accepted often enough to exercise multi-token blocks."""
    gen = torch.Generator().manual_seed(0)
    accepted, longest = 0, 0
    for _ in range(10):
        source = random_source(gen, 12)
        result = _run(0, source, mode=mode, max_new_tokens=40, k=8, gamma=4, num_beams=3, threshold=0.05)
        accepted += result.stats.accepted_tokens
        longest = max(longest, len(result.stats.accepted_per_position))
    assert accepted >= 10
    assert longest >= 3


def test_variable_width_pruning_changes_the_search():
    """Pruning is not a no-op: with a tight delta the beam collapses to fewer hypotheses."""
    source = [5, 6, 7, 8, 9, 10, 11, 12]
    wide = _run(1, source, mode=Mode.BEAM, max_new_tokens=20, num_beams=5)
    pruned = _run(1, source, mode=Mode.BEAM, max_new_tokens=20, num_beams=5, beam_delta=0.0)
    greedy = _run(1, source, mode=Mode.AR, max_new_tokens=20)
    # delta = 0 keeps only the best candidate each step: that is greedy search.
    assert pruned.output_ids == greedy.output_ids
    assert wide.stats.iterations >= pruned.stats.iterations
