"""Bad requests get the status codes of ARCHITECTURE.md with a message, and the servers stay healthy."""

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
    "beta with mode gad": (_request(beta=3), INVALID),
    "k with mode ar": (_request(mode="ar", k=4), INVALID),
    "temperature with mode mjsd": (_request(mode="mjsd", temperature=0.5), INVALID),
}


def test_a_parameter_the_mode_does_not_read_is_refused_by_name(gateway):
    with pytest.raises(grpc.RpcError) as info:
        gateway.Generate(_request(beta=3), timeout=30)
    assert info.value.code() == INVALID
    assert info.value.details() == ("beta does not apply to mode gad (it takes adaptive, k, overlap, preverify, "
                                    "max_new_tokens, output_logprobs, seed and the logits processors)")


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
    "negative top_k": ([_open(), _step(top_k=-1)], INVALID),
    "draft id outside the vocabulary": ([_open(), _step(draft=[999_999])], INVALID),
    "source id outside the vocabulary": ([_open([5, 999_999]), _step()], INVALID),
    "source over the length limit": ([_open([7] * 400), _step()], RANGE),
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


def test_verifier_top_k_zero_reports_top1_only(stack):
    responses = _verify(stack, _open(), _step(0, [5], [6, 7], top_k=0), _step(3, [], [8], top_k=2))
    zero, two = responses[1].step.positions, responses[2].step.positions
    assert len(zero) == 3 and all(not p.topk_ids and not p.topk_logprobs for p in zero)
    assert all(len(p.topk_ids) == 2 and p.topk_ids[0] == p.top1 for p in two)
    # top-1 does not depend on how many candidates are reported.
    assert [p.top1 for p in zero][2] == two[0].top1


def test_model_info_lengths_follow_the_wire_convention(stack, bundle):
    """ModelInfo counts the source's EOS and BOS; `opened` reports output tokens without BOS."""
    max_len = bundle.verifier.config.max_len
    with grpc.insecure_channel(stack.running.addresses["verifier"]) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        info = stub.GetModelInfo(verifier_pb2.VerifierServiceGetModelInfoRequest(), timeout=30).model_info
    assert (info.max_source_len, info.max_target_len) == (max_len, max_len)
    opened = _verify(stack, _open([7] * (max_len - 1)))[0].opened
    assert opened.max_output_len == max_len - 1


def _draft(stack, *requests):
    with grpc.insecure_channel(stack.running.addresses["drafter"]) as channel:
        stub = drafter_pb2_grpc.DrafterServiceStub(channel)
        return list(stub.Draft(iter(requests), timeout=30))


def _draft_open(ids=(5, 6, 7)):
    return drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(source_ids=list(ids), seed=1))


def _sample(gamma=2, temperature=1.0, top_k=0, top_p=0.0):
    sample = drafter_pb2.SampleDraft(gamma=gamma, temperature=temperature, top_k=top_k, top_p=top_p)
    return drafter_pb2.DraftRequest(step=drafter_pb2.DraftStep(committed_len=0, sample=sample))


def _block(k=2, append=()):
    step = drafter_pb2.DraftStep(committed_len=0, append_ids=list(append), block={"k": k})
    return drafter_pb2.DraftRequest(step=step)


BAD_DRAFT = {
    "negative temperature": ([_draft_open(), _sample(temperature=-1.0)], INVALID, "temperature must be"),
    "infinite temperature": ([_draft_open(), _sample(temperature=float("inf"))], INVALID, "temperature must be"),
    "negative top_k": ([_draft_open(), _sample(top_k=-2)], INVALID, "top_k must be >= 0"),
    "top_p over 1": ([_draft_open(), _sample(top_p=1.5)], INVALID, "top_p must be in (0, 1]"),
    "gamma 0": ([_draft_open(), _sample(gamma=0)], INVALID, "gamma must be >= 1"),
    "k 0": ([_draft_open(), _block(k=0)], INVALID, "k must be >= 1"),
    "append id outside the vocabulary": ([_draft_open(), _block(append=[999_999])], INVALID, "append_ids"),
    "source id outside the vocabulary": ([_draft_open([5, 999_999]), _block()], INVALID, "source"),
    "empty source": ([_draft_open(()), _block()], INVALID, "source is empty"),
    "source over the length limit": ([_draft_open([7] * 400), _block()], RANGE, "the limit is"),
    "no method": ([_draft_open(), drafter_pb2.DraftRequest(step=drafter_pb2.DraftStep())], INVALID, "one of"),
}


@pytest.mark.parametrize("case", list(BAD_DRAFT))
def test_bad_drafter_requests(stack, case):
    requests, code, message = BAD_DRAFT[case]
    with pytest.raises(grpc.RpcError) as info:
        _draft(stack, *requests)
    assert info.value.code() == code, info.value.details()
    assert message in info.value.details()


def test_drafter_samples_with_unset_top_p(stack):
    """top_p 0 on the wire is unset: sampling keeps the whole distribution."""
    responses = _draft(stack, _draft_open(), _sample(gamma=3, top_p=0.0))
    result = responses[1].result
    assert len(result.ids) == 3 and len(result.q_rows) == 3
    assert all(abs(sum(row.probs) - 1) < 1e-6 for row in result.q_rows)


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
