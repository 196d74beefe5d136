"""Pre-verify in-process (decoding.policies.preverify), on the tiny float64 models.

With pre-verify the loop equals the plain loop token for token, step for step, for GAD and GAD++
(with the same drafter calls, made on the pool's threads), and for GAD the greedy output; it
pre-verifies exactly the iterations after a cut block; a block cut at its first token is never
sent to the verifier; modes without a rule at one position, and
adaptive requests, never pre-verify; the drafter session never has two calls at once and none when
it closes, whether the decode ends, the verifier fails during the drafter's call, or the drafter
dies (which reaches the caller as the plain loop's `DrafterFailure`, and AR from the committed
prefix completes the greedy output).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.policies.adaptive import load_model
from decoding.policies.loop import DecodeResult
from tests import recording
from tests.property import examples
from tests.recording import (
    Record,
    RecordingDrafter,
    StepsVerifier,
    assert_same_decode,
    block_mode_configs,
    local_drafter,
    local_verifier,
)
from tests.zoo import MAX_LEN, model_pool, random_source
from tests.zoo import sources as zoo_sources
from verifier_service.session import LocalVerifier

PROPERTY = settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _pair(
    trio: int, source: list[int], overlap: bool = False, **params
) -> tuple[DecodeResult, DecodeResult, Record, Record, list[int]]:
    """The plain loop's and the pre-verified loop's (with `overlap` too, if asked) results, each
    one's drafter record, and the draft lengths of the pre-verified loop's verifier steps."""
    plain, pre, plain_record, record, _, counting = _pair_steps(trio, source, overlap, **params)
    return plain, pre, plain_record, record, counting.lengths


def _pair_steps(
    trio: int, source: list[int], overlap: bool = False, **params
) -> tuple[DecodeResult, DecodeResult, Record, Record, StepsVerifier, StepsVerifier]:
    """`_pair`, with both loops' verifiers, which kept every step."""
    runs, records, verifiers = [], [], []
    for preverify in (False, True):
        drafter = RecordingDrafter(local_drafter(trio))
        verifiers.append(StepsVerifier(local_verifier(trio)))
        config = DecodingConfig(preverify=preverify, overlap=overlap and preverify, **params)
        runs.append(decode(source, config, verifiers[-1], drafter))
        records.extend(drafter.records)
    return runs[0], runs[1], records[0], records[1], verifiers[0], verifiers[1]


def _cut_blocks(steps: list[tuple[list[int], list[int]]]) -> list[bool]:
    """For each GAD block of a plain loop's verifier steps: whether it was cut short of its length."""
    cut = []
    for draft, top1 in steps:
        accepted = 0
        while accepted < len(draft) and draft[accepted] == top1[accepted]:
            accepted += 1
        cut.append(accepted < len(draft))
    return cut


def _arguments(record: Record) -> list[tuple]:
    return [(c.method, c.committed_len, c.append_ids, c.size) for c in record.calls]


@PROPERTY
@given(trio=st.integers(0, 3), source=zoo_sources(), max_new=st.integers(1, MAX_LEN - 1), params=block_mode_configs())
def test_preverified_loop_equals_the_plain_loop(trio, source, max_new, params):
    plain, pre, plain_record, record, plain_steps, steps = _pair_steps(trio, source, max_new_tokens=max_new, **params)
    assert_same_decode(plain, pre)
    record.assert_clean()
    s = pre.stats
    assert 0 <= s.preverify_cuts <= s.preverified <= s.iterations
    # The same drafter calls, with the same arguments: the blocks drafted are the plain loop's.
    assert _arguments(record) == _arguments(plain_record)
    # A verifier step per iteration but those cut at pre-verify, plus one plain AR step per pre-verified one.
    assert len(steps.lengths) == s.iterations - s.preverify_cuts + s.preverified
    if params["mode"] == Mode.GAD:
        # Pre-verified: exactly the iterations after a cut block (the plain loop's, step for step).
        cut = _cut_blocks(plain_steps.steps)
        after_cut = zip(cut[:-1], plain_steps.steps[1:], strict=True)
        assert s.preverified == sum(after and bool(draft) for after, (draft, _) in after_cut)
        # Lossless: the verifier's greedy output.
        greedy = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=max_new), local_verifier(trio), None)
        assert pre.output_ids == greedy.output_ids


def test_blocks_cut_at_their_first_token_are_not_verified() -> None:
    """On the worst-matched trio most GAD blocks are cut at their first token: those never reach the
    verifier, so it scores fewer draft tokens than in the plain loop for the same output."""
    gen = torch.Generator().manual_seed(7)
    cuts = scored_plain = scored = 0
    for _ in range(10):
        source = random_source(gen, 24)
        plain, pre, _, record, blocks = _pair(3, source, mode=Mode.GAD, k=4, max_new_tokens=40)
        assert_same_decode(plain, pre)
        record.assert_clean()
        cuts += pre.stats.preverify_cuts
        scored += sum(blocks)
        scored_plain += plain.stats.drafted_tokens
    assert cuts > 0 and scored < scored_plain, (cuts, scored, scored_plain)


def test_modes_without_a_rule_at_one_position_and_adaptive_requests_never_pre_verify() -> None:
    source = [5, 6, 7, 8, 9, 10, 11, 12]
    for mode in (Mode.MJSD, Mode.SPECULATIVE, Mode.IAD, Mode.AR):
        drafter = RecordingDrafter(local_drafter(0))
        config = DecodingConfig(mode=mode, max_new_tokens=30, preverify=True, overlap=False)
        result = decode(source, config, local_verifier(0), drafter)
        assert result.stats.preverified == 0
        assert not any(c.predraft for r in drafter.records for c in r.calls)
    adaptive = DecodingConfig(mode=Mode.GAD, k=4, max_new_tokens=30, preverify=True, overlap=False, adaptive=True)
    assert decode(source, adaptive, local_verifier(0), local_drafter(0)).stats.preverified == 0


@PROPERTY
@given(trio=st.integers(0, 3), source=zoo_sources(), max_new=st.integers(1, MAX_LEN - 1), params=block_mode_configs())
def test_pre_verify_with_overlap_equals_the_plain_loop(trio, source, max_new, params):
    """Both at once: a block drafted ahead and known to be the next one is verified at once (no
    pre-verify step); any other iteration is pre-verified, its draft claiming a pre-draft if one holds."""
    plain, both, plain_record, record, blocks = _pair(trio, source, overlap=True, max_new_tokens=max_new, **params)
    assert_same_decode(plain, both)
    record.assert_clean()
    s = both.stats
    assert 0 <= s.preverify_cuts <= s.preverified <= s.iterations
    assert 0 <= s.predrafts_used <= s.predrafts <= s.iterations
    # Zero-draft steps: pre-verify's, and those of iterations with no room for a draft.
    assert len(blocks) - blocks.count(0) == s.iterations - s.preverify_cuts - (blocks.count(0) - s.preverified)
    # Every drafter call of the plain loop is made, or taken from a pre-draft (a guess and a draft each).
    assert len(record.calls) - 2 * s.predrafts <= len(plain_record.calls) - s.predrafts_used


def test_trained_models_pre_verify_and_use_pre_drafts_together() -> None:
    """On the well-trained trio, with both on: blocks drafted ahead are used and verified at once
    (not every iteration is pre-verified), and pre-verify cuts blocks too."""
    gen = torch.Generator().manual_seed(5)
    used = preverified = iterations = 0
    for _ in range(20):
        source = random_source(gen, 24)
        plain, both, _, record, _ = _pair(0, source, overlap=True, mode=Mode.GAD, k=4, max_new_tokens=60)
        assert_same_decode(plain, both)
        record.assert_clean()
        used += both.stats.predrafts_used
        preverified += both.stats.preverified
        iterations += both.stats.iterations
    assert used > 0 and preverified < iterations, (used, preverified, iterations)


# --- failures while the drafter's call is in flight ---------------------------------------------


def test_a_verifier_failure_waits_for_the_drafter_call_in_flight() -> None:
    source = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 3
    config = DecodingConfig(mode=Mode.GAD, k=3, max_new_tokens=60, preverify=True, overlap=False)
    # Fails at the second plain AR step: pre-verify's, made while the drafter drafts the block.
    def second_plain_step(lengths: list[int]) -> bool:
        return lengths[-1] == 0 and lengths.count(0) == 2

    recording.assert_a_verifier_failure_waits_for_the_pool_call(
        source, config, local_verifier(0), local_drafter(0), fails=second_plain_step
    )


def test_a_drafter_that_dies_during_a_pre_verified_draft_fails_like_a_plain_draft_and_ar_completes_it() -> None:
    source = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 3
    config = DecodingConfig(mode=Mode.GAD, k=3, max_new_tokens=60, preverify=True, overlap=False)
    # The worst-matched trio: ~30 pre-verified drafts on the pool, so the third is there even when a
    # busy machine lets the decode thread draft some itself (the best-matched trio has 6, fewer
    # since a block drafted again comes from the sync's memory).
    recording.assert_a_drafter_death_fails_over_to_ar(source, config, local_verifier(3), local_drafter(3))


def test_drafting_ahead_is_held_back_while_other_requests_decode_on_thelocal_verifier() -> None:
    """Overlap and pre-verify spend work on guesses: with another request decoding on the same
    verifier (AHEAD_MAX_IN_FLIGHT = 1) neither runs, and the output is the same."""
    verifier = LocalVerifier(model_pool()[3].verifier)  # a verifier of its own: its own load
    source = random_source(torch.Generator().manual_seed(7), 24)  # the worst-matched trio: blocks are cut
    config = DecodingConfig(mode=Mode.GAD, k=3, max_new_tokens=40, overlap=True, preverify=True)
    with load_model(verifier).decoding():  # another request, decoding meanwhile
        busy = decode(source, config, verifier, local_drafter(3))
    alone = decode(source, config, verifier, local_drafter(3))
    assert busy.output_ids == alone.output_ids
    assert busy.stats.preverified == busy.stats.predrafts == 0
    assert alone.stats.preverified > 0 and alone.stats.predrafts > 0
