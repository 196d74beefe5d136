"""Realigned block drafts (decoding.policies.drafter_sync, `realign`).

After a block cut at its first token, GAD's next blocks are drafted after the output less its last
token, until the next such cut flips it back; after a block whose verifier token is the draft's
next one (the output dropped a drafted token), they skip one drafted position more, within k. Other
drafts, and syncs without `realign`, never shift. On the tiny float64 models GAD stays the
verifier's greedy output, with and without overlap and pre-verify; on the shipped bundle, whose NAR
drafter runs one token ahead after the verifier inserts one and one behind after it deletes one,
realigned GAD gives greedy's output in fewer iterations than unshifted drafts.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.backends import DEFAULT_BACKEND
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.modes import MODES
from decoding.policies.drafter_sync import DrafterSync, DraftKind
from drafter_service.session import make_drafter
from evaluation.loadtest import ua_gec_texts
from seq2seq_models.bundle import load_bundle
from specdec.api import DEFAULT_BUNDLE_DIR
from tests.property import examples
from tests.recording import RecordingDrafter, local_drafter, local_verifier
from tests.zoo import MAX_LEN, random_source
from tests.zoo import sources as zoo_sources
from verifier_service.session import make_verifier

PROPERTY = settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])


OUTPUTS = [[9, 10, 11, *range(4, 4 + n)] for n in range(8)]  # the output at each call: one token more each


BLOCK = [20, 21, 22, 23]  # the block every verdict below is about


def _verdict(drafted: int, accepted: int, token: int = 99) -> tuple[list[int], int, int]:
    """`accepted` of BLOCK's first `drafted` tokens kept, then the verifier's `token` (99: none of BLOCK's)."""
    return BLOCK[:drafted], accepted, token


def _drafted_after(realign: bool, verdicts: list[tuple[list[int], int, int]], kind=None) -> list[list[int]]:
    """The output each drafter call drafted after, for drafts after OUTPUTS[0], OUTPUTS[1], ... with
    the sync told `verdicts` in between (block drafts of 4 unless `kind`)."""
    recording = RecordingDrafter(local_drafter(0))
    sync = DrafterSync(recording.open([5, 6, 7, 8]), realign)
    seen: list[int] = []
    after = []
    for i, verdict in enumerate([None, *verdicts]):
        if verdict is not None:
            sync.observe(*verdict)
        if kind is None:
            sync.block(OUTPUTS[i], room=8, k=4)
        else:
            sync.draft(kind, OUTPUTS[i], room=8)
        call = recording.records[0].calls[-1]
        seen = [*seen[: call.committed_len], *call.append_ids]
        after.append(list(seen))
    return after


def test_a_block_cut_at_its_first_token_shifts_the_next_drafts_by_one_until_the_next_such_cut() -> None:
    after = _drafted_after(True, [_verdict(4, 0), _verdict(4, 2), _verdict(4, 4), _verdict(4, 0), _verdict(4, 3)])
    assert after == [
        OUTPUTS[0],  # the first block: after the whole output
        OUTPUTS[1][:-1],  # after a block cut at its first token: the output less its last token
        OUTPUTS[2][:-1],  # after one that kept 2: still shifted
        OUTPUTS[3][:-1],  # kept all: still shifted
        OUTPUTS[4],  # cut at its first token again: after the whole output
        OUTPUTS[5],
    ]


def test_without_realign_or_for_other_drafts_nothing_shifts() -> None:
    cuts = [_verdict(4, 0), _verdict(4, 0, token=BLOCK[1]), _verdict(4, 0)]
    assert _drafted_after(False, cuts) == OUTPUTS[:4]
    assert _drafted_after(True, [_verdict(0, 0)] * 3) == OUTPUTS[:4]  # a plain AR step (no draft) is no cut
    assert _drafted_after(True, cuts, DraftKind("draft_beam", 3, (2,))) == OUTPUTS[:4]


def test_a_dropped_drafted_token_makes_the_next_blocks_skip_one_position() -> None:
    """The verifier's token is the draft's next one (cut at 2 with BLOCK[3] there): the next blocks
    are drafted after the whole output with one position more and their first token dropped, still
    k tokens asked; an unexplained cut at the first token then goes back to drafting after it."""
    recording = RecordingDrafter(local_drafter(0))
    sync = DrafterSync(recording.open([5, 6, 7, 8]), realign=True)
    full = sync.block(OUTPUTS[0], room=8, k=4)
    sync.observe(BLOCK, 2, BLOCK[3])
    skipped = sync.block(OUTPUTS[0], room=8, k=4)  # the same output: the same block, less its first token
    assert skipped.ids == full.ids[1:]
    sync.observe(BLOCK, 0, BLOCK[1])  # and again: two positions
    assert sync.block(OUTPUTS[0], room=8, k=4).ids == full.ids[2:]
    sync.observe(BLOCK, 0, 99)  # cut there for no reason the block shows: one position back
    assert sync.block(OUTPUTS[0], room=8, k=4).ids == full.ids[1:]
    assert sync.block(OUTPUTS[0], room=1, k=4).ids == full.ids[:1]  # no room to skip: after the whole output
    calls = recording.records[0].calls
    # Never more than k (or the room) asked; the same call again is answered from memory.
    assert [c.size for c in calls] == [4, 1]
    seen: list[int] = []
    for call in calls:
        seen = [*seen[: call.committed_len], *call.append_ids]
        assert seen == OUTPUTS[0]


def test_a_block_cut_at_its_first_token_is_drafted_again_from_memory() -> None:
    """After a guessed insertion the next block call is the very call just made: the sync answers it
    without the drafter; any other call goes to the drafter."""
    recording = RecordingDrafter(local_drafter(0))
    sync = DrafterSync(recording.open([5, 6, 7, 8]), realign=True, lookahead=True)
    first = sync.block(OUTPUTS[0], room=8, k=4)
    sync.observe(first.ids, 0, 99)  # cut at its first token: the next block comes after OUTPUTS[1][:-1]
    assert sync.block(OUTPUTS[1], room=8, k=4) == first
    assert len(recording.records[0].calls) == 1
    sync.block(OUTPUTS[1], room=4, k=4)  # a block of 4 without its lookahead: another call
    assert [c.size for c in recording.records[0].calls] == [5, 4]


def test_lookahead_blocks_are_drafted_one_position_longer_within_the_room_and_the_drafters_limit() -> None:
    """With `lookahead` a block of k asks the drafter for k + 1 and keeps the last token apart; not
    when the room ends at the block, nor past the drafter's `max_block`."""
    recording = RecordingDrafter(local_drafter(0))
    plain = DrafterSync(recording.open([5, 6, 7, 8])).block(OUTPUTS[0], room=8, k=5)
    sync = DrafterSync(recording.open([5, 6, 7, 8]), lookahead=True, max_block=5)
    block = sync.block(OUTPUTS[0], room=8, k=4)
    assert (block.ids, block.lookahead) == (plain.ids[:4], plain.ids[4])  # the same call as a block of 5
    assert sync.block(OUTPUTS[1], room=4, k=4).lookahead is None  # the output ends with the block
    assert sync.block(OUTPUTS[2], room=8, k=5).lookahead is None  # the drafter takes 5 at most
    assert [c.size for c in recording.records[1].calls] == [5, 4, 5]


@PROPERTY
@given(trio=st.integers(0, 3), source=zoo_sources(), max_new=st.integers(1, MAX_LEN - 1), k=st.integers(1, 16),
       overlap=st.booleans(), preverify=st.booleans())
def test_realigned_gad_is_the_verifier_greedy_output(trio, source, max_new, k, overlap, preverify):
    config = DecodingConfig(mode=Mode.GAD, k=k, max_new_tokens=max_new, overlap=overlap, preverify=preverify)
    gad = decode(source, config, local_verifier(trio), local_drafter(trio))
    greedy = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=max_new), local_verifier(trio), None)
    assert gad.output_ids == greedy.output_ids


def test_decode_shifts_the_drafts_after_cuts_on_the_worst_matched_trio() -> None:
    """Through `decode`: every block is drafted after a prefix of the output, and some right after a
    block cut at its first token come after the same prefix as that block (the output grew by the
    verifier's one token, the draft is shifted by one): the drafter is not asked again, the block is
    the one it drafted; the outputs stay greedy's."""
    gen = torch.Generator().manual_seed(3)
    repeats = reused = 0
    for _ in range(6):
        source = random_source(gen, 20)
        recording = RecordingDrafter(local_drafter(3))
        config = DecodingConfig(mode=Mode.GAD, k=4, max_new_tokens=40, overlap=False, preverify=False)
        gad = decode(source, config, local_verifier(3), recording)
        greedy = decode(source, DecodingConfig(mode=Mode.AR, max_new_tokens=40), local_verifier(3), None)
        assert gad.output_ids == greedy.output_ids
        seen: list[int] = []
        lengths = []
        for call in recording.records[0].calls:
            seen = [*seen[: call.committed_len], *call.append_ids]
            assert seen == gad.output_ids[: len(seen)]
            lengths.append(len(seen))
        # Unshifted, each block comes after a longer output than the one before.
        repeats += sum(a == b for a, b in itertools.pairwise(lengths))
        # Iterations that verified a draft, against the drafter calls made: the rest reused a block.
        reused += sum(gad.stats.steps_per_draft_length[1:]) - len(recording.records[0].calls)
    assert repeats > 0 and reused > 0


@pytest.fixture(scope="module")
def shipped():
    bundle = load_bundle(DEFAULT_BUNDLE_DIR)  # on the default backend, as `specdec decode` runs it
    return bundle, make_verifier(bundle, DEFAULT_BACKEND), make_drafter(bundle, DEFAULT_BACKEND)


@pytest.mark.slow
def test_on_the_shipped_bundle_realigned_gad_needs_fewer_iterations(shipped, monkeypatch):
    """UA-GEC sentences whose correction inserts tokens, and those whose correction deletes some:
    for each, realigned GAD is greedy's output in fewer verifier iterations than GAD with every
    block drafted after the whole output."""
    bundle, verifier, drafter = shipped
    config = DecodingConfig(mode=Mode.GAD, k=10, max_new_tokens=200, overlap=False, preverify=False)
    ar = DecodingConfig(mode=Mode.AR, max_new_tokens=200)
    edits: dict[str, list[tuple[list[int], list[int]]]] = {"inserts": [], "deletes": []}
    for text in ua_gec_texts(120):  # the first 8 whose correction is longer (shorter) than the input
        ids = bundle.tokenizer.encode(text)
        out = decode(ids, ar, verifier, None).output_ids
        edit = "inserts" if len(out) > len(ids) else "deletes" if len(out) < len(ids) else None
        if edit is not None and len(edits[edit]) < 8:
            edits[edit].append((ids, out))
    for edit, pairs in edits.items():
        assert len(pairs) == 8, edit
        sources, greedy = [ids for ids, _ in pairs], [out for _, out in pairs]
        realigned = [decode(s, config, verifier, drafter) for s in sources]
        with monkeypatch.context() as m:
            m.setitem(MODES, Mode.GAD, dataclasses.replace(MODES[Mode.GAD], realign=False))
            unshifted = [decode(s, config, verifier, drafter) for s in sources]
        assert [r.output_ids for r in realigned] == greedy == [r.output_ids for r in unshifted], edit
        iterations = [sum(r.stats.iterations for r in results) for results in (realigned, unshifted)]
        assert iterations[0] < 0.85 * iterations[1], (edit, iterations)
