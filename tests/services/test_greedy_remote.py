"""Runs of AR steps in one round trip (`VerifyStep.greedy_steps`) against a real verifier server,
and the gateway's AR mode over them, on loopback with the tiny bundle."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.peers.remote import RemoteVerifier, fetch_verifier_info
from protos.specdec.v1 import gateway_pb2, verifier_pb2
from tests.services.conftest import verify_stream, wait_until

SOURCES = [[7, 8, 9, 10, 11], [12, 13, 12, 13, 14, 15, 16], [20]]


@pytest.fixture(scope="module")
def remote(verifier_channel):
    return RemoteVerifier(verifier_channel, fetch_verifier_info(verifier_channel))


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(source=st.sampled_from(SOURCES), runs=st.lists(st.integers(1, 9), min_size=1, max_size=5),
       top_k=st.integers(0, 3))
def test_greedy_runs_over_grpc_equal_single_steps(remote, source, runs, top_k):
    """Runs of any sizes, one after another on one stream, give the tokens and candidates of the
    same number of single steps on another stream."""
    run_session, step_session = remote.open(source), remote.open(source)
    try:
        out: list[int] = []
        got = []
        for steps in runs:
            committed, append = (len(out) - 1, out[-1:]) if out else (0, [])
            result = run_session.step_greedy(committed, append, steps, top_k)
            assert 1 <= len(result.top1) <= steps
            got.extend(zip(result.top1, result.topk_ids, strict=True))
            out.extend(result.top1)
        want = []
        for i in range(len(out)):
            single = step_session.step(i - 1 if i else 0, out[i - 1 : i], [], top_k)
            want.append((single.top1[0], single.topk_ids[0]))
        assert got == want
    finally:
        run_session.close()
        step_session.close()


def test_a_run_reports_what_it_committed(verifier_channel):
    """committed_len counts the greedy tokens appended (all but the last), and the session holds
    them: the next step keeps them all."""
    responses = list(verify_stream(
        verifier_channel, SOURCES[0],
        verifier_pb2.VerifyStep(committed_len=0, greedy_steps=5),
        verifier_pb2.VerifyStep(committed_len=4, append_ids=[1], greedy_steps=3),
    ))
    first, second = responses[1].step, responses[2].step
    assert len(first.positions) == 5 and first.committed_len == 4
    assert len(second.positions) == 3 and second.committed_len == 4 + 1 + 2
    assert first.batch_rows >= 1 and first.forward_ms > 0


@pytest.mark.parametrize("step, message", [
    (verifier_pb2.VerifyStep(greedy_steps=-1), "greedy_steps must be >= 0"),
    (verifier_pb2.VerifyStep(draft_ids=[5, 6], greedy_steps=3), "empty draft_ids"),
    (verifier_pb2.VerifyStep(rows=[verifier_pb2.BeamRow(parent=0)], greedy_steps=3), "empty draft_ids"),
])
def test_bad_greedy_steps_are_invalid_argument(verifier_channel, step, message):
    with pytest.raises(grpc.RpcError) as err:
        list(verify_stream(verifier_channel, SOURCES[0], step))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_a_cancelled_run_frees_its_session(stack, verifier_channel):
    """A client that leaves during a long run: the run stops and the session is freed."""
    call = verify_stream(verifier_channel, SOURCES[0],
                         verifier_pb2.VerifyStep(committed_len=0, greedy_steps=100_000))
    next(call)  # opened: the run is queued next
    call.cancel()
    assert wait_until(lambda: stack.running.verifier.active_sessions == 0)


def test_gateway_ar_takes_runs_and_streams_the_first_token_alone(gateway, remote):
    """AR through the gateway: the in-process greedy tokens and iterations; a stream's first
    message carries one token, later ones a run each."""
    config = gateway_pb2.DecodingConfig(mode=gateway_pb2.MODE_AR_GREEDY, max_new_tokens=40)
    reply = gateway.Generate(gateway_pb2.GenerateRequest(input_ids=SOURCES[1], config=config))
    session = remote.open(SOURCES[1])
    try:
        want = [session.step(max(i - 1, 0), reply.output_ids[i - 1 : i], [], 1).top1[0] for i in range(40)]
    finally:
        session.close()
    assert list(reply.output_ids) == want[: len(reply.output_ids)]
    assert reply.stats.iterations == len(reply.output_ids) + (reply.stats.finish_reason == "eos")
    stream = gateway.GenerateStream(gateway_pb2.GenerateRequest(input_ids=SOURCES[1], config=config))
    blocks = [len(m.output_ids) for m in stream if m.output_ids]
    assert blocks[0] == 1
    assert sum(blocks) == len(reply.output_ids)
