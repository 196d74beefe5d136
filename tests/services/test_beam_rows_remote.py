"""The remote verifier session's multi-row step (`VerifyStep.rows`) and the forward's load
figures on every remote result, against a real verifier server on loopback.

These need the verifier server's multi-row support (issue 11, item 3: the scheduler's handling of
`VerifyStep.rows`); a server without it answers a multi-row step with one position and the client
raises `RemoteCallError`.
"""

from __future__ import annotations

import pytest

from core.interfaces import BeamRow
from decoding.policies.beam import BeamSettings, beam_search
from decoding.policies.loop import DecodeStats
from gateway.peers.remote import RemoteVerifier, fetch_verifier_info

SOURCES = [[7, 8, 9, 10, 11], [12, 13, 12, 13, 14, 15, 16], [20]]


@pytest.fixture(scope="module")
def remote(verifier_channel):
    return RemoteVerifier(verifier_channel, fetch_verifier_info(verifier_channel))


@pytest.mark.parametrize("width", [1, 3, 5])
def test_remote_multirow_beam_equals_one_remote_session_per_hypothesis(remote, width):
    """One multi-row stream gives the same search as one single-row stream per hypothesis (the
    adapter), on the same server and so the same backend."""
    for source in SOURCES:
        rows_stats, adapter_stats = DecodeStats(), DecodeStats()
        settings = BeamSettings(width, n_best=width)
        rows = beam_search(remote, source, settings, 16, rows_stats)
        adapter = beam_search(remote, source, settings, 16, adapter_stats, native_rows=False)
        assert [(h.output_ids, h.finish_reason) for h in rows] == [(h.output_ids, h.finish_reason) for h in adapter]
        # One forward for every row, or one each: float32 rounding apart.
        assert [h.score for h in rows] == pytest.approx([h.score for h in adapter], abs=1e-5)
        assert rows_stats.iterations == adapter_stats.iterations
        assert rows_stats.finish_reason == adapter_stats.finish_reason


def test_remote_step_rows_forks_rows_and_reports_the_forward(remote):
    """Rows fork by parent index: each row's scores equal a fresh stream's for the same tokens;
    every result carries the forward's rows, tokens and duration."""
    source = SOURCES[0]
    session = remote.open(source)
    try:
        first = session.step_rows([BeamRow(0, 0, [])], 3)
        assert len(first) == 1
        a, b = first[0].topk_ids[0][:2]
        second = session.step_rows([BeamRow(0, 0, [a]), BeamRow(0, 0, [b])], 3)
        third = session.step_rows([BeamRow(1, 1, [a]), BeamRow(0, 1, [b]), BeamRow(1, 0, [])], 3)
        for results, tokens in ((second, [[a], [b]]), (third, [[b, a], [a, b], []])):
            assert len(results) == len(tokens)
            for res, row_tokens in zip(results, tokens, strict=True):
                fresh = remote.open(source)
                want = fresh.step(0, row_tokens, [], 3)
                fresh.close()
                assert res.topk_ids == want.topk_ids
                assert res.topk_logprobs[0] == pytest.approx(want.topk_logprobs[0], abs=1e-5)
                assert res.batch_rows >= len(results)
                assert res.batch_tokens >= len(results)
                assert res.forward_s > 0
    finally:
        session.close()


def test_remote_single_row_step_reports_the_forward(remote):
    session = remote.open(SOURCES[1])
    try:
        res = session.step(0, [12], [13, 12], 2)
        assert len(res.topk_ids) == 3
        assert res.batch_rows >= 1
        assert res.batch_tokens >= 3  # the append and the draft were in the forward
        assert res.forward_s > 0
    finally:
        session.close()
