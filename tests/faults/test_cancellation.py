"""Cancellation storms (stream and unary) against real `specdec serve` processes.

A cancelled request must stop decoding: its worker, its verifier and drafter sessions and its
place in `gateway_active_requests` are freed within a second, and the next request answers at its
normal latency. The counts here are bounded so each test runs in well under a minute on two cores;
RELIABILITY.md has the 1,000-stream run.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos.specdec.v1 import gateway_pb2_grpc
from tests.faults.requests import LONG, SHORT
from tests.faults.servers import Served, metrics, serve_all, serve_separately, stop_all
from tests.services.conftest import wait_until

STORM = 300  # cancelled requests per storm test
AT_ONCE = 16
CANCEL_AFTER_S = 0.05



@pytest.fixture
def served_all(bundle_dir, tmp_path):
    served = serve_all(bundle_dir, tmp_path)
    try:
        yield served
    finally:
        served.kill()


def _latency(stub, request=SHORT, repeats: int = 5) -> float:
    """The median of a few short requests (one slow scheduling hiccup must not decide a test)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        stub.Generate(request, timeout=30)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def _settled(served: Served) -> dict[str, float]:
    ports = served.metrics_ports
    return {
        "active": metrics(ports["gateway"]).get("specdec_gateway_active_requests", 0.0),
        "verifier": metrics(ports["verifier"]).get("specdec_verifier_active_sessions", 0.0),
        "drafter": metrics(ports["drafter"]).get("specdec_drafter_active_sessions", 0.0),
    }


def _storm(stub, one_cancelled) -> None:
    with ThreadPoolExecutor(AT_ONCE) as pool:
        list(pool.map(one_cancelled, range(STORM)))


def _stream_cancelled(stub):
    def one(_: int) -> None:
        call = stub.GenerateStream(LONG, timeout=60)
        time.sleep(CANCEL_AFTER_S)
        call.cancel()

    return one


def _unary_cancelled(stub):
    def one(_: int) -> None:
        future = stub.Generate.future(LONG, timeout=60)
        time.sleep(CANCEL_AFTER_S)
        future.cancel()

    return one


@pytest.mark.parametrize("kind", ["stream", "unary"])
def test_cancellation_storm_frees_everything(served_all, kind):
    with grpc.insecure_channel(served_all.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        normal = _latency(stub)
        _storm(stub, _stream_cancelled(stub) if kind == "stream" else _unary_cancelled(stub))
        ended = time.monotonic()
        assert wait_until(lambda: _settled(served_all)["active"] == 0, timeout=1.0), _settled(served_all)
        assert time.monotonic() - ended <= 1.5
        assert wait_until(lambda: _settled(served_all) == {"active": 0, "verifier": 0, "drafter": 0}, timeout=2.0)
        after = _latency(stub)
        # "Normal latency": within 3x the pre-storm median plus scheduling noise on a shared 2-core box.
        assert after <= 3 * normal + 0.1, (normal, after)
        gateway = metrics(served_all.metrics_ports["gateway"])
        # No long request ran to its end; none of the cancels was taken for an error or a peer failure.
        assert gateway['specdec_gateway_requests_total{mode="gad"}'] == 10  # the ten short requests
        assert 0 < gateway["specdec_gateway_requests_cancelled_total"] <= STORM
        assert gateway.get("specdec_gateway_errors_total", 0.0) == 0
        assert gateway["specdec_gateway_degraded_total"] == 0
        assert gateway["specdec_gateway_deadline_exceeded_total"] == 0


def test_cancel_while_verifier_stalled_frees_workers_at_once(bundle_dir, tmp_path):
    """Workers blocked in a verifier step must stop when their client cancels, not when the step ends."""
    served = serve_separately(bundle_dir, tmp_path)
    try:
        with grpc.insecure_channel(served["gateway"].address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            stub.Generate(SHORT, timeout=30)
            served["verifier"].signal(signal.SIGSTOP)
            try:
                calls = [stub.GenerateStream(LONG, timeout=60) for _ in range(AT_ONCE)]
                gateway = served["gateway"]
                # Admission runs as many as there are workers; the rest wait in the gateway's queue.
                def in_gateway() -> float:
                    return gateway.metric("specdec_gateway_active_requests") + gateway.metric(
                        "specdec_gateway_queued_requests"
                    )

                assert wait_until(lambda: in_gateway() == AT_ONCE, 5.0)
                assert gateway.metric("specdec_gateway_active_requests") > 0  # some are blocked in a verifier step
                for call in calls:
                    call.cancel()
                assert wait_until(lambda: in_gateway() == 0, timeout=1.0)
            finally:
                served["verifier"].signal(signal.SIGCONT)
            assert wait_until(lambda: served["verifier"].metric("specdec_verifier_active_sessions") == 0, 5.0)
            assert wait_until(lambda: served["drafter"].metric("specdec_drafter_active_sessions") == 0, 5.0)
            assert gateway.metric("specdec_gateway_requests_cancelled_total") == AT_ONCE
            assert gateway.metric("specdec_gateway_degraded_total") == 0
            assert len(stub.Generate(SHORT, timeout=30).output_ids) == 8
    finally:
        stop_all(served)
