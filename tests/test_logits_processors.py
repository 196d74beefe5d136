"""`core.logits_processors` against `transformers`' own LogitsProcessor classes: on random scores
(raw logits, as greedy search processes them, and log-softmax scores, as beam search does) and random
decoder inputs, each processor alone and all of them in `generate()`'s order give exactly the scores
`transformers` gives (numpy and torch alike); the incremental row state, pushed and rolled back at
random, plans as a state built afresh does."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")

from core.logits_processors import NONE, Processors, RowState, apply_processing, processing  # noqa: E402

VOCAB = 12
EOS, START = 2, 0
CASES = 300


def _hf(s: Processors, encoder_ids: list[int]) -> list:
    """generate()'s processors for `s`, in generate()'s order (`_get_logits_processor`)."""
    out = []
    if s.repetition_penalty != 1.0:
        out.append(lp.RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    if s.no_repeat_ngram_size:
        out.append(lp.NoRepeatNGramLogitsProcessor(s.no_repeat_ngram_size))
    if s.encoder_no_repeat_ngram_size:
        out.append(lp.EncoderNoRepeatNGramLogitsProcessor(s.encoder_no_repeat_ngram_size, torch.tensor([encoder_ids])))
    if s.bad_words_ids:
        out.append(lp.NoBadWordsLogitsProcessor([list(w) for w in s.bad_words_ids], EOS))
    if s.min_length:
        out.append(lp.MinLengthLogitsProcessor(s.min_length, EOS))
    if s.min_new_tokens:
        out.append(lp.MinNewTokensLengthLogitsProcessor(1, s.min_new_tokens, EOS))
    if s.forced_bos_token_id != NONE:
        out.append(lp.ForcedBOSTokenLogitsProcessor(s.forced_bos_token_id))
    if s.forced_eos_token_id != NONE:
        out.append(lp.ForcedEOSTokenLogitsProcessor(s.max_length, s.forced_eos_token_id))
    if s.suppress_tokens:
        out.append(lp.SuppressTokensLogitsProcessor(list(s.suppress_tokens)))
    if s.begin_suppress_tokens:
        out.append(lp.SuppressTokensAtBeginLogitsProcessor(list(s.begin_suppress_tokens), s.begin_index))
    return out


def _settings(rng: random.Random, only: str | None) -> Processors:
    """Random settings: every processor on or off at random, or only `only`."""
    tokens = lambda k: tuple(rng.sample(range(3, VOCAB), k))  # noqa: E731 - never the forced ones
    options = {
        "repetition_penalty": lambda: rng.choice([1.3, 0.7, 2.0, 1.0001]),
        "no_repeat_ngram_size": lambda: rng.randint(1, 4),
        "encoder_no_repeat_ngram_size": lambda: rng.randint(1, 3),
        "bad_words_ids": lambda: tuple(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 3)))
                                       for _ in range(rng.randint(1, 4))),
        "min_length": lambda: rng.randint(1, 8),
        "min_new_tokens": lambda: rng.randint(1, 8),
        "forced_bos_token_id": lambda: 1,
        "forced_eos_token_id": lambda: EOS,
        "suppress_tokens": lambda: tokens(rng.randint(1, 3)),
        "begin_suppress_tokens": lambda: tokens(rng.randint(1, 3)),
    }
    chosen = {only} if only else {name for name in options if rng.random() < 0.5}
    values = {name: make() for name, make in options.items() if name in chosen}
    return Processors(**values, max_length=rng.randint(2, 12), begin_index=rng.choice([1, 2]))


def _case(rng: random.Random, only: str | None, logprob_space: bool):
    """(settings, decoder input, encoder input, scores [V] float32)."""
    s = _settings(rng, only)
    s = Processors(**{**s.__dict__, "logprob_space": logprob_space})
    period = rng.randint(1, 4)  # repeated patterns, so that n-grams and bad words match
    pattern = [rng.randrange(1, VOCAB) for _ in range(period)]
    length = rng.randint(0, 14)
    decoder = [START] + [pattern[i % period] if rng.random() < 0.8 else rng.randrange(VOCAB) for i in range(length)]
    encoder = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 10))] + [EOS]
    if rng.random() < 0.5:  # the encoder's n-grams in the output too
        decoder[1:1] = encoder[: rng.randint(1, len(encoder))]
    scores = torch.randn(VOCAB, generator=torch.Generator().manual_seed(rng.randrange(2**31))) * 3
    if logprob_space:
        scores = torch.log_softmax(scores, -1)
    return s, decoder, encoder, scores


def _ours(s: Processors, decoder: list[int], encoder: list[int], scores: torch.Tensor, as_torch: bool):
    state = RowState.open(s, EOS, START, encoder)
    state.sync(decoder)
    p = processing([state.plan()], [s])
    assert p is not None
    if as_torch:
        out = scores.clone()[None]
        apply_processing(out, p.map(lambda a: torch.from_numpy(a).to(torch.float32) if a.dtype == np.float64
                                    else torch.from_numpy(a)))
        return out[0]
    out = scores.numpy().copy()[None]
    apply_processing(out, p.map(lambda a: a.astype(np.float32) if a.dtype == np.float64 else a))
    return torch.from_numpy(out[0])


ONLY = [None, "repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
        "min_length", "min_new_tokens", "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens",
        "begin_suppress_tokens"]


@pytest.mark.parametrize("space", ["logits", "logprobs"])
@pytest.mark.parametrize("only", ONLY, ids=[o or "all-at-random" for o in ONLY])
def test_processed_scores_equal_transformers(only, space):
    rng = random.Random(f"{only}-{space}")
    for _ in range(CASES if only is None else CASES // 3):
        s, decoder, encoder, scores = _case(rng, only, space == "logprobs")
        want = scores.clone()[None]
        for proc in _hf(s, encoder):
            want = proc(torch.tensor([decoder]), want)
        for as_torch in (False, True):
            got = _ours(s, decoder, encoder, scores, as_torch)
            assert torch.equal(got, want[0]), (s, decoder, encoder, got, want[0])


def test_the_incremental_state_plans_as_a_fresh_one():
    """Pushes, roll-backs and forks at random: every plan equals the plan of a state built afresh
    from the same decoder input."""
    rng = random.Random(5)
    for _ in range(60):
        s, _, encoder, _ = _case(rng, None, False)
        state = RowState.open(s, EOS, START, encoder)
        for _ in range(40):
            if rng.random() < 0.3 and len(state.tokens) > 1:
                state.truncate(rng.randint(1, len(state.tokens)))
            elif rng.random() < 0.1:
                state = state.fork()
            else:
                state.push(rng.randrange(1, 5))
            fresh = RowState.open(s, EOS, START, encoder)
            fresh.sync(state.tokens)
            want, got = fresh.plan(), state.plan()
            assert (set(got.penalized), set(got.banned), got.forced) == (set(want.penalized), set(want.banned),
                                                                          want.forced)


@pytest.mark.parametrize("penalty", [0.0, -1.0, 5e-324, 1e-31, 1e31, float("nan"), float("inf")])
def test_a_penalty_whose_scaled_scores_overflow_float32_is_refused(penalty):
    with pytest.raises(ValueError, match="repetition_penalty must be in"):
        Processors(repetition_penalty=penalty).check(VOCAB)


@pytest.mark.parametrize("penalty", [1e-30, 0.5, 1.3, 1e30])
def test_penalties_at_the_bounds_keep_scores_finite(penalty):
    Processors(repetition_penalty=penalty).check(VOCAB)
    rng = random.Random(penalty)
    for _ in range(20):
        s, decoder, encoder, scores = _case(rng, None, False)
        s = Processors(repetition_penalty=penalty)
        got = _ours(s, decoder, encoder, scores * 100, False)
        assert torch.isfinite(got).all()
