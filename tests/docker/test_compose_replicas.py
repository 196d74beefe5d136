"""docker-compose.replicas.yml for real: two verifier replicas behind one gateway. Under load from 8
clients one replica is killed (SIGKILL, no drain): no request fails and every output equals the
in-process greedy output; the replica started again is healthy and the stack keeps serving."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import grpc
import pytest

from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.docker.test_compose_stack import ROOT, TEXTS, Stack, image, timings  # noqa: F401 - fixtures

REPLICAS_FILE = ROOT / "docker-compose.replicas.yml"
CLIENTS = 8
REQUESTS_PER_CLIENT = 6
MODES = ("gad", "ar")


@pytest.fixture(scope="module")
def replicas(request):
    # The image the compose-stack tests build (their module's fixture, imported above).
    s = Stack(request.getfixturevalue("image"), REPLICAS_FILE, name="replicas")
    try:
        s.compose("up", "-d", timeout=600)
        s.wait_healthy("gateway")
        yield s
    finally:
        s.compose("down", "--timeout", "20", check=False)
        left = s.containers()
        assert not left, f"containers left after down: {left}"


def _greedy() -> dict[str, list[int]]:
    """In-process AR greedy of every text on the same bundle: what every lossless request must return."""
    proc = subprocess.run([sys.executable, "-m", "specdec", "decode", "--mode", "ar", "--bundle",
                           str(ROOT / "bundles" / "ua-gec")], input="\n".join(TEXTS) + "\n",
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return {t: json.loads(line)["output_ids"] for t, line in zip(TEXTS, proc.stdout.splitlines(), strict=True)}


def test_killing_a_verifier_replica_under_load_fails_no_request(replicas):
    want = _greedy()
    failures: list[str] = []
    wrong: list[tuple[str, str]] = []
    done = [0]
    lock = threading.Lock()
    kill_at = threading.Event()

    def client(n: int) -> None:
        with grpc.insecure_channel(replicas.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            for i in range(REQUESTS_PER_CLIENT):
                text, mode = TEXTS[(n + i) % len(TEXTS)], MODES[(n + i) % len(MODES)]
                config = overrides_to_wire({"mode": mode, **({"k": 10} if mode == "gad" else {})})
                try:
                    reply = stub.Generate(gateway_pb2.GenerateRequest(text=text, config=config), timeout=120)
                except grpc.RpcError as exc:
                    with lock:
                        failures.append(f"{exc.code().name}: {exc.details()}")
                    continue
                if list(reply.output_ids) != want[text]:
                    with lock:
                        wrong.append((mode, text))
                with lock:
                    done[0] += 1
                    if done[0] == CLIENTS:  # the load is on: every client has had one answer
                        kill_at.set()

    threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
    for t in threads:
        t.start()
    assert kill_at.wait(300), "the load never started"
    replicas.compose("kill", "-s", "SIGKILL", "verifier-2")
    for t in threads:
        t.join(600)
    assert not any(t.is_alive() for t in threads)
    assert failures == [] and wrong == [], (failures, wrong)
    assert done[0] == CLIENTS * REQUESTS_PER_CLIENT

    # Started again, it is healthy, and the stack still answers every mode with the same output.
    replicas.compose("start", "verifier-2")
    replicas.wait_healthy("verifier-2")
    with grpc.insecure_channel(replicas.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for text in TEXTS:
            reply = stub.Generate(gateway_pb2.GenerateRequest(text=text), timeout=120)
            assert list(reply.output_ids) == want[text]
