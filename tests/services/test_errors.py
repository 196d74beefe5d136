"""Bad requests get the DESIGN status codes with a message, and the servers stay healthy."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.wire import overrides_to_wire
from protos.specdec.v1 import drafter_pb2, drafter_pb2_grpc, gateway_pb2, verifier_pb2, verifier_pb2_grpc

TEXT = "We have been living in this city."
INVALID, RANGE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE


def _request(text=TEXT, ids=None, mode_number=None, **overrides):
    config = overrides_to_wire({"mode": "gad", "max_new_tokens": 8, **overrides})
    if mode_number is not None:
        config.mode = mode_number
    return gateway_pb2.GenerateRequest(text=text, input_ids=ids or [], config=config)


BAD_REQUESTS = {
    "empty text": (_request(text=""), INVALID),
    "text and ids": (_request(ids=[5, 6]), INVALID),
    "unknown mode": (_request(mode_number=99), INVALID),
    "k = 0": (_request(k=0), INVALID),
    "k over the limit": (_request(k=65), RANGE),
    "beta = 0": (_request(mode="gad++", beta=0), INVALID),
    "tau < 0": (_request(mode="gad++", tau=-0.5), INVALID),
    "threshold 0": (_request(mode="mjsd", threshold=0.0), INVALID),
    "threshold over 1": (_request(mode="mjsd", threshold=1.5), INVALID),
    "ids outside the vocabulary": (_request(text="", ids=[5, 100000]), INVALID),
    "negative id": (_request(text="", ids=[-1, 5]), INVALID),
    "source over the length limit": (_request(text="", ids=[7] * 400), RANGE),
    "max_new_tokens 0": (_request(max_new_tokens=0), INVALID),
    "max_new_tokens over the limit": (_request(max_new_tokens=10_000), RANGE),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_gateway_requests(gateway, case):
    request, code = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as info:
        gateway.Generate(request, timeout=30)
    assert info.value.code() == code, info.value.details()
    assert info.value.details()


def _verify(stack, *requests):
    with grpc.insecure_channel(stack.running.addresses["verifier"]) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        return list(stub.Verify(iter(requests), timeout=30))


def _open(ids=(5, 6, 7)):
    return verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=list(ids)))


def _step(committed_len=0, append=(), draft=(), top_k=1):
    step = verifier_pb2.VerifyStep(committed_len=committed_len, append_ids=list(append), draft_ids=list(draft),
                                   top_k=top_k)
    return verifier_pb2.VerifyRequest(step=step)


BAD_VERIFY = {
    "step out of order": ([_open(), _step(0, [5], [6]), _step(5)], grpc.StatusCode.FAILED_PRECONDITION),
    "step before open": ([_step()], INVALID),
    "open twice": ([_open(), _open()], INVALID),
    "empty source": ([_open(()), _step()], INVALID),
    "draft over the limit": ([_open(), _step(draft=[5] * 200)], RANGE),
    "top_k over the vocabulary": ([_open(), _step(top_k=100_000)], INVALID),
    "append id outside the vocabulary": ([_open(), _step(append=[999_999])], INVALID),
}


@pytest.mark.parametrize("case", list(BAD_VERIFY))
def test_bad_verifier_streams(stack, case):
    requests, code = BAD_VERIFY[case]
    with pytest.raises(grpc.RpcError) as info:
        _verify(stack, *requests)
    assert info.value.code() == code, info.value.details()
    assert info.value.details()


def test_verifier_allows_rollback_and_full_vocabulary(stack, bundle):
    vocab = bundle.verifier.config.vocab_size
    responses = _verify(stack, _open(), _step(0, [5, 6], [7, 8], top_k=vocab), _step(1, [], [9], top_k=vocab))
    assert responses[0].WhichOneof("kind") == "opened"
    assert len(responses[1].step.positions) == 3 and len(responses[1].step.positions[0].topk_ids) == vocab
    # Rolled back below the earlier commit of 2 (beam search re-targets sessions this way).
    assert responses[2].step.committed_len == 1


def test_bad_drafter_streams(stack):
    with grpc.insecure_channel(stack.running.addresses["drafter"]) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        step = drafter_pb2.DraftRequest(step=drafter_pb2.DraftStep(committed_len=0, block={"k": 2}))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Draft(iter([step]), timeout=30))
        assert info.value.code() == INVALID
        opened = drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(source_ids=[5, 6]))
        too_long = drafter_pb2.DraftRequest(step=drafter_pb2.DraftStep(committed_len=0, block={"k": 1000}))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Draft(iter([opened, too_long]), timeout=30))
        assert info.value.code() == RANGE


def test_servers_stay_healthy_after_bad_requests(stack, gateway):
    for case in BAD_REQUESTS.values():
        with pytest.raises(grpc.RpcError):
            gateway.Generate(case[0], timeout=30)
    for address in stack.running.addresses.values():
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    ok = gateway.Generate(_request(), timeout=30)
    assert ok.final
