"""The Triton-hosted verifier (`specdec export-triton` + gateway.peers.triton) against the real
`tritonserver` binary on a loopback port (marker `triton`; skipped, saying why, where it cannot run):
every mode through the gateway gives the native verifier's tokens, a cancelled request's sequence is
freed, sessions expire, and bad steps get our status codes."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from core.errors import SpecdecError, StatusCode
from decoding.config import Mode
from decoding.modes import MODES as MODE_SPECS
from gateway.peers.remote import CallOptions
from gateway.peers.triton import TritonVerifierClient
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from specdec.serve import ServiceStack
from tests.services.conftest import LOOPBACK, wait_until
from tests.services.test_modes import MODES, TEXTS
from tests.triton.tritonserver import start_triton, why_not_runnable
from verifier_service.triton_export import TritonExportOptions, export_triton

pytestmark = pytest.mark.triton
MODEL, SHORT_LIVED = "specdec_verifier", "specdec_verifier_idle"
IDLE_S = 1.0


@pytest.fixture(scope="module")
def triton(bundle_dir, tmp_path_factory):
    reason = why_not_runnable()
    if reason:
        print(f"\nSKIP triton tests: {reason}")
        pytest.skip(reason)
    repository = tmp_path_factory.mktemp("triton-repo")
    export_triton(bundle_dir, repository, TritonExportOptions(model=MODEL, max_sessions=16))
    export_triton(bundle_dir, repository, TritonExportOptions(model=SHORT_LIVED, session_idle_s=IDLE_S))
    server = start_triton(repository, Path(repository) / "tritonserver.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def triton_gateway(bundle_dir, triton):
    sections = {**LOOPBACK, "gateway": {**LOOPBACK["gateway"], "verifier_url": triton.url(MODEL)}}
    with ServiceStack("all", bundle_dir, sections) as stack, grpc.insecure_channel(
        stack.running.addresses["gateway"]
    ) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


@pytest.fixture(scope="module")
def client(triton):
    c = TritonVerifierClient(triton.grpc_address, MODEL)
    yield c
    c.close()


def live_sessions(triton, model: str = MODEL) -> int:
    """The model's live sessions, as a fresh sequence sees them (itself excluded)."""
    with triton_grpc.InferenceServerClient(triton.grpc_address) as c:
        ids = triton_grpc.InferInput("SOURCE_IDS", [1], "INT64")
        ids.set_data_from_numpy(np.asarray([5], dtype=np.int64))
        result = c.infer(model, [ids], sequence_id=987_654_321, sequence_start=True, sequence_end=True)
        return int(result.as_numpy("SESSIONS")[0])


def _request(mode: Mode, text: str, **extra) -> gateway_pb2.GenerateRequest:
    overrides = {"mode": mode.value, **MODES[mode], "max_new_tokens": 24, "seed": 5, **extra}
    return gateway_pb2.GenerateRequest(text=text, config=overrides_to_wire(overrides))


@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.value)
def test_every_mode_equals_the_native_verifier(triton_gateway, gateway, mode):
    for text in TEXTS:
        native = gateway.Generate(_request(mode, text), timeout=60)
        hosted = triton_gateway.Generate(_request(mode, text), timeout=60)
        assert list(hosted.output_ids) == list(native.output_ids), (mode, MODE_SPECS[mode].lossless)
        assert hosted.text == native.text
        assert hosted.stats.iterations == native.stats.iterations
        assert not hosted.stats.degraded


def test_model_info_comes_from_the_export(client, bundle):
    info = client.fetch_info(timeout=10)
    cfg = bundle.verifier.config
    assert (info.vocab_size, info.bos_id, info.eos_id) == (cfg.vocab_size, cfg.bos_id, cfg.eos_id)
    assert info.tokenizer_fingerprint == bundle.tokenizer.fingerprint
    assert info.backend == "triton-torch-cpu"


def test_bad_steps_get_our_status_codes(client, triton):
    verifier = client.verifier(client.fetch_info(timeout=10), CallOptions())
    cases = [
        (lambda s: s.step(3, [], [], 1), StatusCode.FAILED_PRECONDITION, "committed_len 3"),
        (lambda s: s.step(0, [], [999_999], 1), StatusCode.INVALID_ARGUMENT, "draft_ids"),
        (lambda s: s.step(0, [-1], [], 1), StatusCode.INVALID_ARGUMENT, "append_ids"),
        (lambda s: s.step(0, [], [], 100_000), StatusCode.INVALID_ARGUMENT, "top_k"),
        (lambda s: s.step(0, [], list(range(5, 5 + 200)), 1), StatusCode.OUT_OF_RANGE, "draft has 200"),
    ]
    for call, code, words in cases:
        session = verifier.open([5, 6, 7])
        with pytest.raises(SpecdecError) as info:
            call(session)
        session.close()
        assert info.value.code == code and words in info.value.message, info.value
    with pytest.raises(SpecdecError) as info:
        verifier.open([5, 999_999]).step(0, [], [], 1)
    assert info.value.code == StatusCode.INVALID_ARGUMENT and "source" in info.value.message
    # A step of a sequence never started: Triton's sequence batcher itself refuses it, clearly.
    with triton_grpc.InferenceServerClient(client.address) as c:
        inputs = []
        for name, value in (("COMMITTED_LEN", 0), ("TOP_K", 1)):
            inputs.append(triton_grpc.InferInput(name, [1], "INT64"))
            inputs[-1].set_data_from_numpy(np.asarray([value], dtype=np.int64))
        with pytest.raises(InferenceServerException) as refused:
            c.infer(MODEL, inputs, sequence_id=424_242)
        assert refused.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        assert "must specify the START flag" in refused.value.message()
    assert live_sessions(triton) == 0  # every failed session above was ended and freed


def test_sessions_end_with_their_request_and_when_cancelled(triton_gateway, triton):
    triton_gateway.Generate(_request(Mode.GAD, TEXTS[0]), timeout=60)
    assert live_sessions(triton) == 0
    # A long request cancelled once it has streamed its first tokens: its sequence is ended.
    stream = triton_gateway.GenerateStream(_request(Mode.AR, TEXTS[1], max_new_tokens=200), timeout=60)
    next(stream)
    assert live_sessions(triton) == 1
    stream.cancel()
    assert wait_until(lambda: live_sessions(triton) == 0, timeout=10)


def test_idle_sessions_expire_in_the_model(triton):
    c = TritonVerifierClient(triton.grpc_address, SHORT_LIVED)
    try:
        session = c.verifier(c.fetch_info(timeout=10), CallOptions()).open([5, 6, 7])
        first = session.step(0, [], [], 1)
        time.sleep(IDLE_S + 0.5)
        with pytest.raises(SpecdecError) as info:
            session.step(1, [], [], 1)
        assert info.value.code == StatusCode.FAILED_PRECONDITION and "expired" in info.value.message
        assert first.top1
        session.close()
        assert live_sessions(triton, SHORT_LIVED) == 0
    finally:
        c.close()
