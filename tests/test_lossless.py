"""Losslessness, property-tested on random tiny models and random sources (float64: no near-ties).

IAD and GAD equal AR greedy; GAD++ with beta=1 (or tau=0) equals GAD; MJSD with threshold 1
equals greedy; fixed beam width 1 equals greedy; variable-width beam without pruning equals
fixed width; with random logits processors on (core.logits_processors), every lossless mode still
equals greedy with the same processors. Sources have length 1..64 and repeated tokens, so IAD's
unique-match rule meets both unique and ambiguous n-grams.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from unittest.mock import patch

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.multirow import has_rows
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.modes import MODES
from decoding.policies.loop import DecodeResult, DecodeStats
from drafter_service.session import LocalDrafter
from tests.property import examples
from tests.zoo import FIRST_WORD, MAX_LEN, VOCAB, model_pool, random_source
from tests.zoo import sources as zoo_sources
from verifier_service.session import LocalVerifier

EXAMPLES = examples(200)
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

sources = zoo_sources()
lengths = st.integers(1, MAX_LEN - 1)
trios = st.integers(0, 3)


@functools.cache
def _endpoints(trio_index: int) -> tuple[LocalVerifier, LocalDrafter]:
    """One verifier and one drafter per trio, shared by every example (both are stateless: all
    per-decode state lives in the sessions they open)."""
    trio = model_pool()[trio_index]
    return LocalVerifier(trio.verifier), LocalDrafter(trio.drafter_models())


def _run(trio_index: int, source: list[int], **overrides) -> DecodeResult:
    verifier, drafter = _endpoints(trio_index)
    return decode(source, DecodingConfig(**overrides), verifier, drafter)


# (trio, source) -> the longest AR greedy decode made so far for it.
_GREEDY: dict[tuple[int, tuple[int, ...]], DecodeResult] = {}


def _greedy(trio_index: int, source: list[int], max_new: int) -> DecodeResult:
    """AR greedy with `max_new` tokens. Greedy commits one token per step, so a shorter budget
    gives a prefix of a longer one: each (trio, source) is decoded again only for a budget larger
    than any before, when that decode was cut by length rather than ended by EOS
    (test_greedy_reference_is_the_prefix_of_the_longest checks this against a real decode)."""
    key = (trio_index, tuple(source))
    known = _GREEDY.get(key)
    if known is None or (known.stats.finish_reason == "length" and max_new > len(known.output_ids)):
        known = _GREEDY[key] = _run(trio_index, source, mode=Mode.AR, max_new_tokens=max_new)
    longest = known.output_ids
    if max_new <= len(longest):
        ids, finish, iterations = longest[:max_new], "length", max_new
    else:  # the decode stopped at EOS before max_new: one more step produced the EOS
        ids, finish, iterations = longest, "eos", len(longest) + 1
    stats = DecodeStats(iterations=iterations, output_tokens=len(ids), finish_reason=finish)
    return DecodeResult(list(ids), stats)


@settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trio=trios, source=sources, max_new=lengths)
def test_greedy_reference_is_the_prefix_of_the_longest(trio, source, max_new):
    _greedy(trio, source, MAX_LEN - 1)  # the reference is then cut from the longest decode
    real = _run(trio, source, mode=Mode.AR, max_new_tokens=max_new)
    reference = _greedy(trio, source, max_new)
    assert real.output_ids == reference.output_ids
    assert real.stats.finish_reason == reference.stats.finish_reason
    assert real.stats.iterations == reference.stats.iterations


def _equals_greedy(trio: int, source: list[int], max_new: int, mode: Mode, **overrides) -> DecodeResult:
    greedy = _greedy(trio, source, max_new)
    result = _run(trio, source, mode=mode, max_new_tokens=max_new, **overrides)
    assert result.output_ids == greedy.output_ids
    assert result.stats.finish_reason == greedy.stats.finish_reason
    if mode != Mode.BEAM:  # beam search counts its steps differently
        assert result.stats.iterations <= greedy.stats.iterations
    return result


@PROPERTY
@given(trio=trios, source=sources, max_new=lengths, k=st.integers(1, 40))
def test_iad_equals_greedy(trio, source, max_new, k):
    _equals_greedy(trio, source, max_new, Mode.IAD, k=k)


@PROPERTY
@given(trio=trios, source=sources, max_new=lengths, k=st.integers(1, 25))
def test_gad_equals_greedy(trio, source, max_new, k):
    _equals_greedy(trio, source, max_new, Mode.GAD, k=k)


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
    """Step for step against GAD's rule on the same drafts: GAD with its drafts unshifted and without
    the lookahead position (GAD++ drafts neither, decoding.policies.drafter_sync), and GAD as it runs
    gives the same output."""
    beta, tau = beta_tau
    gad = _run(trio, source, mode=Mode.GAD, max_new_tokens=max_new, k=k)
    with patch.dict(MODES, {Mode.GAD: dataclasses.replace(MODES[Mode.GAD], realign=False, lookahead=False)}):
        unshifted = _run(trio, source, mode=Mode.GAD, max_new_tokens=max_new, k=k)
    gadpp = _run(trio, source, mode=Mode.GAD_PLUS_PLUS, max_new_tokens=max_new, k=k, beta=beta, tau=tau)
    assert gadpp.output_ids == unshifted.output_ids == gad.output_ids
    assert gadpp.stats.iterations == unshifted.stats.iterations


@PROPERTY
@given(trio=trios, source=sources, max_new=lengths, gamma=st.integers(1, 8), beams=st.integers(1, 6))
def test_mjsd_with_threshold_1_equals_greedy(trio, source, max_new, gamma, beams):
    _equals_greedy(trio, source, max_new, Mode.MJSD, gamma=gamma, num_beams=beams, threshold=1.0)


@PROPERTY
@given(trio=trios, source=sources, max_new=lengths)
def test_beam_width_1_equals_greedy(trio, source, max_new):
    _equals_greedy(trio, source, max_new, Mode.BEAM, num_beams=1)


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
        beam_max_candidates=2 * width,  # generate()'s search keeps 2 * width candidates a step
    )
    assert variable.output_ids == fixed.output_ids
    assert variable.stats.iterations == fixed.stats.iterations


WORDS = st.integers(FIRST_WORD, VOCAB - 1)
# Random processors; n-grams from 2 (a bigram ban over 16 tokens cannot empty a row in 30 tokens).
PROCESSORS = st.fixed_dictionaries({}, optional={
    "repetition_penalty": st.sampled_from([0.8, 1.3, 2.0]),
    "no_repeat_ngram_size": st.integers(2, 4),
    "encoder_no_repeat_ngram_size": st.integers(2, 3),
    "bad_words_ids": st.lists(st.lists(WORDS, min_size=1, max_size=3), min_size=1, max_size=3),
    "min_length": st.integers(0, 20),
    "min_new_tokens": st.integers(0, 20),
    "forced_eos_token_id": st.just(3),
    "suppress_tokens": st.lists(WORDS, max_size=3),
    "begin_suppress_tokens": st.lists(WORDS, max_size=3),
})


@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trio=trios, source=sources, max_new=st.integers(1, 30), k=st.integers(1, 12), processors=PROCESSORS)
def test_lossless_modes_equal_greedy_with_processors(trio, source, max_new, k, processors):
    """Each drafted position is verified against the processed top-1 given the prefix accepted so
    far, so IAD, GAD, GAD++ with beta 1 and MJSD with threshold 1 still equal greedy."""
    settings = {"max_new_tokens": max_new, **processors}
    greedy = _run(trio, source, mode=Mode.AR, **settings)
    runs = {
        "iad": _run(trio, source, mode=Mode.IAD, k=k, **settings),
        "gad": _run(trio, source, mode=Mode.GAD, k=k, **settings),
        "gad++": _run(trio, source, mode=Mode.GAD_PLUS_PLUS, k=k, beta=1, **settings),
        "mjsd": _run(trio, source, mode=Mode.MJSD, gamma=4, num_beams=2, threshold=1.0, **settings),
    }
    for mode, result in runs.items():
        assert result.output_ids == greedy.output_ids, mode
        assert result.stats.finish_reason == greedy.stats.finish_reason, mode


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    trio=trios,
    source=sources,
    max_new=st.integers(2, MAX_LEN - 1),
    cut=st.floats(0, 1),
    mode=st.sampled_from([Mode.AR, Mode.GAD, Mode.BEAM]),
)
def test_continuing_a_committed_prefix_gives_the_same_output(trio, source, max_new, cut, mode):
    """The gateway's fallback continues from what is already committed: for a lossless mode the
    result is the same as decoding from scratch. So does beam search of width 1 (a forced first
    token is such a prefix), streaming only what it adds."""
    greedy = _greedy(trio, source, max_new)
    n = min(int(cut * len(greedy.output_ids)), max_new - 1)
    prefix = greedy.output_ids[:n]
    verifier, drafter = _endpoints(trio)
    config = DecodingConfig(mode=mode, max_new_tokens=max_new, **({"num_beams": 1} if mode == Mode.BEAM else {"k": 5}))
    streamed: list[int] = []
    resumed = decode(source, config, verifier, drafter, on_tokens=streamed.extend, prefix=prefix)
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


class _CountingVerifier(LocalVerifier):
    """The real verifier, counting the sessions a search opens (one per live hypothesis slot)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.opened = 0

    def open(self, source_ids: list[int]):
        self.opened += 1
        return super().open(source_ids)


@pytest.mark.parametrize("pruning", [{"beam_delta": 0.0}, {"beam_max_candidates": 1}], ids=["delta0", "M1"])
def test_variable_width_pruning_changes_the_search(pruning):
    """Pruning is not a no-op. On this source the width-5 beam finds a better (length-normalised)
    output than greedy; pruning to delta = 0 (only the best candidate survives each step) or to
    M = 1 (one candidate per parent) collapses the beam to a single hypothesis, so the search
    becomes greedy search: a different output, and (without multi-row sessions) one verifier session
    instead of five."""
    source = [5, 6, 7, 8, 9, 10, 11, 12]
    model = model_pool()[1].verifier
    wide_verifier, pruned_verifier = _CountingVerifier(model), _CountingVerifier(model)
    model_verifier = LocalVerifier(model)
    config = {"mode": Mode.BEAM, "max_new_tokens": 20, "num_beams": 5}
    wide = decode(source, DecodingConfig(**config), wide_verifier)
    pruned = decode(source, DecodingConfig(**config, **pruning), pruned_verifier)
    greedy = _greedy(1, source, 20)
    assert wide.output_ids != greedy.output_ids, "the case needs a beam that beats greedy"
    assert pruned.output_ids == greedy.output_ids
    assert pruned.output_ids != wide.output_ids
    assert pruned_verifier.opened == 1
    # One multi-row session where the backend has them; else one single-row session per hypothesis.
    assert wide_verifier.opened == (1 if has_rows(model_verifier.open(source)) else 5)
