"""Health, reflection, metrics, cancellation, drafter loss and SIGTERM draining."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.serve import ServiceStack
from tests.services.conftest import free_port, spawn_specdec, wait_ready_line, wait_until
from tests.services.test_modes import _in_process

TEXT = "We have been living in this city."
LONG = {"mode": "gad", "k": 4, "max_new_tokens": 200, "seed": 1}


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_health_serving_after_warm_up(stack):
    for name, address in stack.running.addresses.items():
        assert _health(address) == health_pb2.HealthCheckResponse.SERVING, name


def test_reflection_lists_the_services(stack):
    expected = {
        "verifier": "specdec.v1.VerifierService",
        "drafter": "specdec.v1.DrafterService",
        "gateway": "specdec.v1.GatewayService",
    }
    for name, address in stack.running.addresses.items():
        with grpc.insecure_channel(address) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert expected[name] in services
        assert "grpc.health.v1.Health" in services


def test_metrics_endpoints(stack, gateway):
    gateway.Generate(gateway_pb2.GenerateRequest(text=TEXT, config=overrides_to_wire({"max_new_tokens": 4})))
    for server, names in (
        (stack.running.gateway, ["specdec_gateway_requests_total", "specdec_gateway_accepted_tokens_total"]),
        (stack.running.verifier, ["specdec_verifier_active_sessions", "specdec_verifier_kv_cache_bytes"]),
        (stack.running.drafter, ["specdec_drafter_active_sessions", "specdec_drafter_draft_tokens_total"]),
    ):
        url = f"http://127.0.0.1:{server.host.metrics_port}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        for name in names:
            assert f"\n{name}" in body or body.startswith(name) or f"# TYPE {name}" in body


def test_cancel_mid_stream_frees_sessions(stack, gateway):
    request = gateway_pb2.GenerateRequest(text=TEXT, config=overrides_to_wire(LONG))
    call = gateway.GenerateStream(request, timeout=60)
    next(call)  # decoding is under way: both sessions are open
    assert stack.running.verifier.active_sessions >= 1
    call.cancel()
    running = stack.running
    assert wait_until(lambda: running.verifier.active_sessions == 0 and running.drafter.active_sessions == 0)
    assert stack.running.verifier.streams.m_active.value() == 0


def test_a_cancelled_stream_leaves_no_task_pending(stack, gateway):
    """A GenerateStream cut short by its client ends its wait for the next block: nothing pending is
    left to be garbage-collected ("Task was destroyed but it is pending!")."""
    import gc

    messages: list[str] = []
    stack.loop.set_exception_handler(lambda loop, context: messages.append(context.get("message", "")))
    try:
        for _ in range(3):
            call = gateway.GenerateStream(gateway_pb2.GenerateRequest(text=TEXT, config=overrides_to_wire(LONG)),
                                          timeout=60)
            next(call)
            call.cancel()
        running = stack.running
        assert wait_until(lambda: running.verifier.active_sessions == 0 and running.drafter.active_sessions == 0)
        time.sleep(0.2)
        gc.collect()
    finally:
        stack.loop.set_exception_handler(None)
    assert [m for m in messages if "destroyed" in m] == []


def test_verifier_stream_cancel_frees_session(stack):
    with grpc.insecure_channel(stack.running.addresses["verifier"]) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        gate = threading.Event()

        def requests():
            yield verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=[5, 6]))
            gate.wait(10)

        call = stub.Verify(requests(), timeout=30)
        next(call)
        assert stack.running.verifier.active_sessions == 1
        call.cancel()
        gate.set()
    assert wait_until(lambda: stack.running.verifier.active_sessions == 0)


def test_drafter_killed_mid_run_falls_back_then_recovers(bundle_dir, bundle):
    port = free_port()
    drafter = spawn_specdec("serve", "drafter", "--bundle", str(bundle_dir), "--drafter-addr", f"127.0.0.1:{port}")
    try:
        wait_ready_line(drafter)
        sections = {
            "verifier": {"address": "127.0.0.1:0"},
            # A retry window longer than one request: back-to-back requests while the drafter is down
            # must not keep pushing the window forward, or the drafter is never used again.
            "gateway": {"address": "127.0.0.1:0", "drafter_retry_s": 1.0, "drafter_address": f"127.0.0.1:{port}"},
        }
        with ServiceStack("verifier", Path(bundle_dir), sections) as v:
            sections["gateway"]["verifier_address"] = v.running.addresses["verifier"]
            with ServiceStack("gateway", Path(bundle_dir), sections) as g, grpc.insecure_channel(
                g.running.addresses["gateway"]
            ) as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                expected = _in_process(bundle, TEXT, LONG).output_ids
                request = gateway_pb2.GenerateRequest(text=TEXT, config=overrides_to_wire(LONG))
                call = stub.GenerateStream(request, timeout=60)
                chunks = [next(call)]
                drafter.kill()  # mid-run
                drafter.wait()
                chunks += list(call)
                assert [i for c in chunks for i in c.output_ids] == expected
                assert chunks[-1].stats.degraded
                again = stub.Generate(request, timeout=60)
                assert list(again.output_ids) == expected and again.stats.degraded

                # Steady traffic from now on, through the drafter's restart: every answer must be
                # the same, and once the drafter is back the requests must stop being degraded.
                degraded_flags: list[bool] = []
                outputs_ok: list[bool] = []
                stop = threading.Event()

                def traffic() -> None:
                    while not stop.is_set():
                        response = stub.Generate(request, timeout=60)
                        outputs_ok.append(list(response.output_ids) == expected)
                        degraded_flags.append(response.stats.degraded)

                sender = threading.Thread(target=traffic, daemon=True)
                sender.start()
                try:
                    drafter = spawn_specdec(
                        "serve", "drafter", "--bundle", str(bundle_dir), "--drafter-addr", f"127.0.0.1:{port}"
                    )
                    wait_ready_line(drafter)
                    assert wait_until(lambda: bool(degraded_flags) and not degraded_flags[-1], timeout=15)
                finally:
                    stop.set()
                    sender.join(timeout=60)
                assert all(outputs_ok) and True in degraded_flags
    finally:
        drafter.kill()
        drafter.wait()


def test_sigterm_drains_in_flight_sessions(bundle_dir):
    port = free_port()
    proc = spawn_specdec("serve", "verifier", "--bundle", str(bundle_dir), "--verifier-addr", f"127.0.0.1:{port}")
    try:
        address = wait_ready_line(proc)
        assert _health(address) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(address) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            queue: list = [verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=[5, 6]))]
            more = threading.Event()
            done = threading.Event()

            def requests():
                yield queue.pop(0)
                more.wait(20)
                yield verifier_pb2.VerifyRequest(step=verifier_pb2.VerifyStep(committed_len=0, top_k=1))
                done.wait(20)

            call = stub.Verify(requests(), timeout=30)
            assert next(call).WhichOneof("kind") == "opened"
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            # Draining: the open session still gets its step answered; new sessions are refused.
            more.set()
            assert next(call).WhichOneof("kind") == "step"
            done.set()
            assert list(call) == []
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        proc.wait()
