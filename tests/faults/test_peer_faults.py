"""Peer faults against separate `specdec serve` processes: a hung drafter (SIGSTOP), a drafter
killed mid-stream, a verifier killed and restarted.

Only the peer's own failure or timeout counts against it: a hung drafter times out on the
drafter's cap and the requests fall back to AR within their deadlines (same output, lossless
modes); a dead verifier is UNAVAILABLE until it is back.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.faults.servers import serve_separately, stop_all
from tests.services.conftest import wait_until

TEXT = "We have been living in this city."
GAD = {"mode": "gad", "k": 4, "max_new_tokens": 200, "seed": 1}
GREEDY = {"mode": "ar", "max_new_tokens": 200, "seed": 1}
DEADLINE_S = 10.0


def _request(overrides: dict) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(text=TEXT, config=overrides_to_wire(overrides))



@pytest.fixture
def served(bundle_dir, tmp_path):
    # The drafter's stream gets 3 s per request before the gateway gives up on it; retried 0.5 s later.
    # The cap covers the whole request, so it must exceed a healthy GAD request even on a loaded CI
    # machine (at 1 s a 200-token request right after the verifier's restart tripped it).
    running = serve_separately(bundle_dir, tmp_path, gateway={"drafter_timeout_s": 3.0, "drafter_retry_s": 0.5})
    try:
        yield running
    finally:
        stop_all(running)


def test_hung_drafter_falls_back_within_deadline(served):
    with grpc.insecure_channel(served["gateway"].address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        expected = list(stub.Generate(_request(GREEDY), timeout=DEADLINE_S).output_ids)
        assert not stub.Generate(_request(GAD), timeout=DEADLINE_S).stats.degraded
        served["drafter"].signal(signal.SIGSTOP)
        try:
            for _ in range(4):
                started = time.monotonic()
                response = stub.Generate(_request(GAD), timeout=DEADLINE_S)
                assert time.monotonic() - started < DEADLINE_S
                assert response.stats.degraded
                assert list(response.output_ids) == expected
        finally:
            served["drafter"].signal(signal.SIGCONT)
        # Back: within a few retry windows the drafter is used again.
        assert wait_until(lambda: not stub.Generate(_request(GAD), timeout=DEADLINE_S).stats.degraded, 10.0)
        assert served["gateway"].metric("specdec_gateway_deadline_exceeded_total") == 0
        assert served["gateway"].metric("specdec_gateway_requests_cancelled_total") == 0


def test_drafter_killed_mid_stream_completes_degraded_and_lossless(served):
    with grpc.insecure_channel(served["gateway"].address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        expected = list(stub.Generate(_request(GREEDY), timeout=DEADLINE_S).output_ids)
        call = stub.GenerateStream(_request(GAD), timeout=DEADLINE_S)
        chunks = [next(call)]  # decoding is under way with the drafter
        served["drafter"].kill()
        chunks += list(call)
        assert [i for c in chunks for i in c.output_ids] == expected
        assert chunks[-1].final and chunks[-1].stats.degraded
        assert served["gateway"].metric("specdec_gateway_degraded_total") == 1
        assert wait_until(lambda: served["verifier"].metric("specdec_verifier_active_sessions") == 0, 5.0)


def test_verifier_down_is_unavailable_then_recovers(served):
    with grpc.insecure_channel(served["gateway"].address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        expected = list(stub.Generate(_request(GAD), timeout=DEADLINE_S).output_ids)
        served["verifier"].kill()
        codes = set()
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as raised:
                stub.Generate(_request(GAD), timeout=DEADLINE_S)
            codes.add(raised.value.code())
        assert codes == {grpc.StatusCode.UNAVAILABLE}
        served["verifier"].restart().wait_ready()

        def answers() -> bool:
            try:
                return list(stub.Generate(_request(GAD), timeout=DEADLINE_S).output_ids) == expected
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                return False

        assert wait_until(answers, timeout=20.0)
        # The verifier's outage is the verifier's: it opened no drafter retry window.
        assert not stub.Generate(_request(GAD), timeout=DEADLINE_S).stats.degraded
