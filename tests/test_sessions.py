"""The session protocol of verifier and drafter sessions, and its status codes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.errors import StatusCode
from drafter_service.session import LocalDrafter
from tests.checks import assert_verifier_status_codes, status_code
from tests.zoo import model_pool
from verifier_service.session import LocalVerifier


@pytest.fixture(scope="module")
def trio():
    return model_pool()[0]


def test_verify_step_returns_the_full_recompute_distribution(trio):
    model = trio.verifier
    source = [5, 6, 7, 8, 9]
    session = LocalVerifier(model).open(source)
    res1 = session.step(0, [11, 12], [13, 14, 15], top_k=4)
    # Then reject after d_1 and correct: keep 2 + 1 tokens, append the correction.
    res2 = session.step(3, [6], [7, 8], top_k=4)
    cfg = model.config
    src = torch.tensor([[*source, cfg.eos_id]])
    for tokens, res in (([11, 12, 13, 14, 15], res1), ([11, 12, 13, 6, 7, 8], res2)):
        with torch.no_grad():
            full = model(src, torch.ones_like(src, dtype=torch.bool), torch.tensor([[cfg.bos_id, *tokens]]))
        logprobs = F.log_softmax(full[0], -1)
        n = len(res.draft_logprobs)
        rows = logprobs[len(tokens) - n :]
        assert res.top1 == rows.argmax(-1).tolist()
        assert [ids[:4] for ids in res.topk_ids] == rows.topk(4).indices.tolist()
        drafted = tokens[len(tokens) - n :]
        expected = [rows[i, t].item() for i, t in enumerate(drafted)]
        assert res.draft_logprobs == pytest.approx(expected, abs=1e-9)


def test_verifier_status_codes(trio):
    assert_verifier_status_codes(LocalVerifier(trio.verifier))


def test_drafter_sessions(trio):
    drafter = LocalDrafter(trio.drafter_models())
    session = drafter.open([5, 6, 7, 8])
    block = session.draft_block(0, [], k=5)
    assert len(block.ids) == 5
    # Drafting leaves the state untouched: the same request drafts the same block.
    assert session.draft_block(0, [], k=5).ids == block.ids
    assert status_code(lambda: session.draft_block(3, [], k=2)) == StatusCode.FAILED_PRECONDITION
    assert status_code(lambda: session.draft_beam(0, [], gamma=2, num_beams=2)) == StatusCode.FAILED_PRECONDITION

    beam_session = drafter.open([5, 6, 7, 8])
    draft = beam_session.draft_beam(0, [9], gamma=4, num_beams=3)
    assert 1 <= len(draft.ids) <= 4 and len(draft.cum_logq) == len(draft.ids)
    assert all(b <= a + 1e-12 for a, b in zip(draft.cum_logq, draft.cum_logq[1:], strict=False))
    # A drafter with only an AR model drafts a block greedily: its beam of width 1.
    only_ar = LocalDrafter({"ar_drafter": trio.ar_drafter})
    block = only_ar.open([5]).draft_block(0, [9], k=4)
    assert block.ids == only_ar.open([5]).draft_beam(0, [9], gamma=4, num_beams=1).ids and 1 <= len(block.ids) <= 4


def test_beam_draft_cum_logq_is_the_drafters_joint_log_prob(trio):
    model = trio.ar_drafter
    session = LocalDrafter({"ar_drafter": model}).open([5, 6, 7])
    draft = session.draft_beam(0, [8, 9], gamma=3, num_beams=4)
    cfg = model.config
    src = torch.tensor([[5, 6, 7, cfg.eos_id]])
    tokens = [cfg.bos_id, 8, 9, *draft.ids]
    with torch.no_grad():
        logprobs = F.log_softmax(model(src, torch.ones_like(src, dtype=torch.bool), torch.tensor([tokens]))[0], -1)
    steps = [logprobs[2 + i, t].item() for i, t in enumerate(draft.ids)]
    expected = torch.tensor(steps, dtype=torch.float64).cumsum(0).tolist()
    assert draft.cum_logq == pytest.approx(expected, abs=1e-9)
