"""IAD where the model is (`VerifyStep.copy_draft`) against a real verifier server, and the gateway's
IAD over it, on loopback with the tiny bundle."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.peers.remote import RemoteVerifier, RemoteVerifierSession, fetch_verifier_info
from protos.specdec.v1 import gateway_pb2, verifier_pb2
from tests.services.conftest import verify_stream

# The second and third copy parts of themselves, so that the tiny model meets its source again.
SOURCES = [[7, 8, 9, 10, 11], [12, 13, 12, 13, 14, 15, 16], [20], [30, 31, 32, 30, 31, 32, 30, 31]]


@pytest.fixture(scope="module")
def remote(verifier_channel):
    return RemoteVerifier(verifier_channel, fetch_verifier_info(verifier_channel))


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(source=st.sampled_from(SOURCES), runs=st.lists(st.integers(2, 12), min_size=1, max_size=4),
       k=st.integers(1, 9), top_k=st.integers(0, 3))
def test_copy_runs_over_grpc_equal_greedy_runs(remote, source, runs, k, top_k):
    """Runs of copy drafts, one after another on one stream, give the tokens and candidates of the
    same greedy runs on another stream; each forward drafted at most k tokens and kept no more."""
    copy_session, greedy_session = remote.open(source), remote.open(source)
    try:
        out: list[int] = []
        for steps in runs:
            committed, append = (len(out) - 1, out[-1:]) if out else (0, [])
            copied = copy_session.step_copy(committed, append, steps, top_k, k)
            plain = greedy_session.step_greedy(committed, append, steps, top_k)
            assert (copied.top1, copied.topk_ids) == (plain.top1, plain.topk_ids)
            assert copied.blocks and all(0 <= a <= d <= k for d, a in copied.blocks)
            kept = sum(a for _, a in copied.blocks)
            assert kept <= len(copied.top1) <= kept + len(copied.blocks)
            out.extend(copied.top1)
            if copied.top1[-1] == remote.eos_id:
                break
    finally:
        copy_session.close()
        greedy_session.close()


def test_a_copy_run_reports_what_it_committed_and_drafted(verifier_channel):
    """committed_len counts the run's tokens appended (all but the last), as a greedy run's does, and
    the next step keeps them all; the blocks say what each forward drafted."""
    responses = list(verify_stream(
        verifier_channel, SOURCES[3],
        verifier_pb2.VerifyStep(committed_len=0, greedy_steps=6, copy_draft=4),
        verifier_pb2.VerifyStep(committed_len=5, append_ids=[1], greedy_steps=3, copy_draft=4),
    ))
    first, second = responses[1].step, responses[2].step
    assert 1 <= len(first.positions) <= 6 and first.committed_len == len(first.positions) - 1
    assert second.committed_len == first.committed_len + 1 + len(second.positions) - 1
    assert first.blocks and first.blocks[0].drafted == 4  # BOS lines the source's start up: a copy at once
    assert all(b.accepted <= b.drafted <= 4 for b in (*first.blocks, *second.blocks))


@pytest.mark.parametrize("step, code, message", [
    (verifier_pb2.VerifyStep(greedy_steps=5, copy_draft=-1), grpc.StatusCode.INVALID_ARGUMENT, "copy_draft must be"),
    (verifier_pb2.VerifyStep(copy_draft=4), grpc.StatusCode.INVALID_ARGUMENT, "needs greedy_steps > 1"),
    (verifier_pb2.VerifyStep(greedy_steps=5, copy_draft=100_000), grpc.StatusCode.OUT_OF_RANGE, "the limit is"),
    (verifier_pb2.VerifyStep(draft_ids=[5], greedy_steps=5, copy_draft=4), grpc.StatusCode.INVALID_ARGUMENT,
     "empty draft_ids"),
])
def test_bad_copy_drafts_end_the_stream_with_a_status(verifier_channel, step, code, message):
    with pytest.raises(grpc.RpcError) as err:
        list(verify_stream(verifier_channel, SOURCES[3], step))
    assert err.value.code() == code
    assert message in err.value.details()


@pytest.mark.parametrize("source", SOURCES)
def test_gateway_iad_runs_on_the_verifier_and_equals_ar(gateway, monkeypatch, source):
    """IAD of a fixed k through the gateway: one copy run per round trip, the AR tokens, and stats of
    its forwards; adaptive IAD (a block per iteration from the load) and a stream keep the gateway's
    loop."""
    calls = []
    step_copy = RemoteVerifierSession.step_copy

    def counted(self, *args, **kwargs):
        calls.append(args)
        return step_copy(self, *args, **kwargs)

    monkeypatch.setattr(RemoteVerifierSession, "step_copy", counted)

    def generate(mode: int, **fields) -> gateway_pb2.GenerateResponse:
        config = gateway_pb2.DecodingConfig(mode=mode, max_new_tokens=30, **fields)
        return gateway.Generate(gateway_pb2.GenerateRequest(input_ids=source, config=config))

    ar = generate(gateway_pb2.MODE_AR_GREEDY)
    iad = generate(gateway_pb2.MODE_IAD, block_size=6)
    assert list(iad.output_ids) == list(ar.output_ids)
    assert len(calls) == 1 and calls[0][-1] == 6
    stats = iad.stats
    assert sum(stats.steps_per_draft_length) == stats.iterations
    assert stats.accepted_tokens <= stats.drafted_tokens
    assert stats.iterations <= ar.stats.iterations
    adaptive = generate(gateway_pb2.MODE_IAD, block_size=6, adaptive_k=True)
    assert list(adaptive.output_ids) == list(ar.output_ids)
    assert len(calls) == 1
    # A stream keeps the gateway's loop: its pieces are the loop's blocks (tests/services/test_http_ua_gec.py
    # checks their provenance), the same tokens.
    config = gateway_pb2.DecodingConfig(mode=gateway_pb2.MODE_IAD, max_new_tokens=30, block_size=6)
    stream = gateway.GenerateStream(gateway_pb2.GenerateRequest(input_ids=source, config=config))
    assert [t for m in stream for t in m.output_ids] == list(ar.output_ids)
    assert len(calls) == 1


def test_a_k_past_the_verifiers_draft_limit_runs_at_the_limit(remote):
    """A request's k may exceed the verifier's max_draft_len (the gateway's limits are its own): the
    run's blocks are the verifier's longest, where the verifier would refuse the larger copy_draft."""
    limit = remote.info.max_draft_len
    session = remote.open(SOURCES[3])
    try:
        result = session.step_copy(0, [], 12, 0, limit + 10)
        assert result.blocks and all(drafted <= limit for drafted, _ in result.blocks)
    finally:
        session.close()
