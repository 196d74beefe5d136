"""The accept rules on hand-built verifier answers, one branch at a time."""

from __future__ import annotations

import math

from core.copy_draft import CopyDrafter
from core.interfaces import VerifyResult
from decoding.policies.accept import accept_exact, accept_gad_plus_plus, accept_mjsd


def _result(top1, topk_ids, topk_logprobs, draft_logprobs):
    return VerifyResult(top1=top1, topk_ids=topk_ids, topk_logprobs=topk_logprobs, draft_logprobs=draft_logprobs)


RES = _result(
    top1=[10, 11, 12, 13],
    topk_ids=[[10, 20, 30], [11, 21, 31], [12, 22, 32], [13, 23, 33]],
    topk_logprobs=[[-0.1, -1.0, -3.0], [-0.2, -0.5, -4.0], [-0.3, -2.5, -2.6], [-0.1, -0.2, -0.3]],
    draft_logprobs=[-0.1, -0.5, -2.6],
)


def test_exact_accepts_up_to_the_first_mismatch_then_the_verifiers_token():
    assert accept_exact([10, 11, 12], RES) == (3, 13)  # all match: bonus token
    assert accept_exact([10, 21, 12], RES) == (1, 11)
    assert accept_exact([99, 11, 12], RES) == (0, 10)
    assert accept_exact([], RES) == (0, 10)


def test_gad_plus_plus_needs_top_beta_and_the_tau_gap():
    draft = [10, 21, 32]  # ranks 1, 2, 3; gaps 0, 0.3, 2.3
    assert accept_gad_plus_plus(draft, RES, beta=3, tau=3.0) == (3, 13)
    assert accept_gad_plus_plus(draft, RES, beta=3, tau=2.0) == (2, 12)  # gap 2.3 > tau
    assert accept_gad_plus_plus(draft, RES, beta=2, tau=3.0) == (2, 12)  # 32 not in top-2
    assert accept_gad_plus_plus(draft, RES, beta=1, tau=9.0) == (1, 11)  # beta 1 is GAD
    assert accept_gad_plus_plus(draft, RES, beta=3, tau=0.0) == (1, 11)  # tau 0 is GAD


def test_mjsd_takes_the_longest_passing_prefix_even_after_a_failing_one():
    # P = -0.1, -0.6, -3.2 ; Q chosen so prefix 1 passes, prefix 2 fails, prefix 3 passes.
    draft = [10, 21, 32]
    cum_logq = [-0.1, -0.1, -3.0]
    threshold = 0.7  # log 0.7 = -0.357: passes when P_i - Q_i > -0.357
    assert accept_mjsd(draft, cum_logq, RES, threshold) == (3, 13)
    assert accept_mjsd(draft, [-0.1, -0.1, -2.0], RES, threshold) == (1, 11)
    # Prefix 1 has P > Q (ratio capped at 1); prefix 2: -0.6 + 0.1 = -0.5 > log 0.5; prefix 3 fails.
    assert accept_mjsd(draft, [-0.5, -0.1, -2.0], RES, 0.5) == (2, 12)
    assert accept_mjsd(draft, cum_logq, RES, 1.0) == (0, 10)  # threshold 1: nothing passes
    assert accept_mjsd(draft, cum_logq, RES, math.exp(-50)) == (3, 13)


def test_copy_drafter_uses_the_longest_unique_suffix_match():
    bos, eos = 2, 3
    source = [5, 6, 7, 5, 6, 8, 9]
    copier = CopyDrafter(source, bos, eos, cap=10)
    # At the start BOS lines up with the source start.
    assert copier.propose([], room=20).ids == [5, 6, 7, 5, 6, 8, 9, eos]
    # "5 6" occurs twice; "7 5 6" once: copy what follows it.
    assert copier.propose([7, 5, 6], room=20).ids == [8, 9, eos]
    # "6" and "5 6" are ambiguous: the occurrence nearest where the output would be had it copied
    # since its last unique match (BOS, three tokens back: position 4) is taken, the first "5 6".
    assert copier.propose([1, 5, 6], room=20).ids == [7, 5, 6, 8, 9, eos]
    assert copier.propose([5, 6, 7, 5, 6], room=20).ids == [8, 9, eos]
    # Unique single token.
    assert copier.propose([4, 8], room=20).ids == [9, eos]
    # The cap and the room bound the draft.
    assert CopyDrafter(source, bos, eos, cap=2).propose([], room=20).ids == [5, 6]
    assert copier.propose([], room=3).ids == [5, 6, 7]
    # A token the source lacks: copying goes on past the source token it replaced.
    assert copier.propose([4], room=20).ids == [6, 7, 5, 6, 8, 9, eos]
    assert copier.propose([5, 6, 7, 4], room=20).ids == [6, 8, 9, eos]
    # No unique match within MAX_BACK tokens: no draft.
    assert copier.propose([4] * 10, room=20).ids == []
