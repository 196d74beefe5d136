"""Expired deadlines mixed with normal traffic: one client's short deadlines degrade no one else.

Client A sends GAD requests whose 50 ms deadline passes mid-decode (often while the drafter is
drafting); client B sends short GAD requests with a 30 s deadline at the same time. A's deadlines
are A's own: they are counted in `gateway_deadline_exceeded`, never taken for a drafter failure,
so the drafter retry window stays shut and none of B's answers is `degraded`.
"""

from __future__ import annotations

import threading
import time

import grpc

from protos.specdec.v1 import gateway_pb2_grpc
from tests.faults.requests import LONG, SHORT
from tests.faults.servers import metrics, serve_all

EXPIRING = 150  # client A's requests, 50 ms deadline each
A_DEADLINE_S = 0.05
B_REQUESTS = 60



def test_expired_deadlines_degrade_no_other_client(bundle_dir, tmp_path):
    # A retry window far longer than the test: one wrongly opened window would degrade every B request after it.
    served = serve_all(bundle_dir, tmp_path, gateway={"drafter_retry_s": 30.0})
    try:
        with grpc.insecure_channel(served.address) as a_channel, grpc.insecure_channel(served.address) as b_channel:
            a = gateway_pb2_grpc.GatewayServiceStub(a_channel)
            b = gateway_pb2_grpc.GatewayServiceStub(b_channel)
            a_codes: list[grpc.StatusCode] = []

            def client_a() -> None:
                for _ in range(EXPIRING):
                    try:
                        a.Generate(LONG, timeout=A_DEADLINE_S)
                        a_codes.append(grpc.StatusCode.OK)
                    except grpc.RpcError as exc:
                        a_codes.append(exc.code())

            senders = [threading.Thread(target=client_a, daemon=True) for _ in range(3)]
            for t in senders:
                t.start()
            b_degraded = []
            started = time.monotonic()
            while len(b_degraded) < B_REQUESTS and time.monotonic() - started < 40:
                b_degraded.append(b.Generate(SHORT, timeout=30).stats.degraded)
            for t in senders:
                t.join(timeout=60)
            assert len(b_degraded) == B_REQUESTS
            assert sum(b_degraded) == 0
            assert set(a_codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
            # And one more after the burst: the drafter is still in use.
            assert not b.Generate(SHORT, timeout=30).stats.degraded
        gateway = metrics(served.metrics_ports["gateway"])
        assert gateway["specdec_gateway_degraded_total"] == 0
        assert 0 < gateway["specdec_gateway_deadline_exceeded_total"] <= 3 * EXPIRING
        assert gateway.get("specdec_gateway_errors_total", 0.0) == 0
        assert gateway["specdec_gateway_requests_cancelled_total"] == 0
        assert metrics(served.metrics_ports["verifier"])["specdec_verifier_active_sessions"] == 0
        assert metrics(served.metrics_ports["drafter"])["specdec_drafter_active_sessions"] == 0
    finally:
        served.kill()
