"""A verifier replica killed with SIGKILL under load from 8 clients (gateway.peers.failover): no request
fails, every lossless output equals in-process greedy, and the replica, restarted on its address,
takes sessions again.

The verifiers are `specdec serve verifier` processes (so one can be killed for real); the two
drafter replicas and the gateway run in this process.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack

import grpc

from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from seq2seq_models.bundle import load_bundle
from specdec.serve import ServiceStack
from tests.services.conftest import free_port, spawn_specdec, wait_ready_line, wait_until
from verifier_service.session import make_verifier

TEXTS = ["We have been living in this city.", "The weather is nice today.", "Where is the station?"]
MAX_NEW = 120
MODES = [{"mode": "gad", "k": 4, "max_new_tokens": MAX_NEW, "seed": 1}, {"mode": "ar", "max_new_tokens": MAX_NEW}]
CLIENTS = 8


def test_a_verifier_replica_killed_under_load_fails_no_request_and_is_used_again(bundle_dir):
    bundle = load_bundle(bundle_dir)
    reference = make_verifier(bundle, "onnxruntime")
    greedy = DecodingConfig(mode=Mode.AR, max_new_tokens=MAX_NEW)
    expected = {t: decode(bundle.tokenizer.encode(t), greedy, reference, None).output_ids for t in TEXTS}
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]

    def spawn(address: str):
        return spawn_specdec("serve", "verifier", "--bundle", str(bundle_dir), "--verifier-addr", address)

    verifiers = [spawn(a) for a in addresses]
    try:
        for proc in verifiers:
            wait_ready_line(proc, 90)
        with ExitStack() as stack:
            loopback = {"drafter": {"address": "127.0.0.1:0"}}
            drafters = [stack.enter_context(ServiceStack("drafter", bundle_dir, loopback)) for _ in range(2)]
            sections = {"gateway": {
                "address": "127.0.0.1:0", "verifier_address": ",".join(addresses),
                "drafter_address": ",".join(d.running.addresses["drafter"] for d in drafters),
            }}
            gateway = stack.enter_context(ServiceStack("gateway", bundle_dir, sections)).running.gateway
            load = _Load(f"127.0.0.1:{gateway.host.port}")
            load.start()
            try:
                victim = addresses[0]
                sessions = gateway.metrics.replica_sessions
                on_victim = lambda: sessions.value(role="verifier", replica=victim) > 0  # noqa: E731
                assert wait_until(lambda: load.done() >= CLIENTS and on_victim(), 30.0)
                verifiers[0].kill()  # SIGKILL, with sessions in flight on it
                verifiers[0].wait(10)
                done_at_kill = load.done()
                assert wait_until(lambda: load.done() >= done_at_kill + 2 * CLIENTS, 60.0)
                assert gateway.verifiers.usable() == [addresses[1]]
                verifiers[0] = spawn(victim)  # restarted on its address
                wait_ready_line(verifiers[0], 90)
                assert wait_until(lambda: victim in gateway.verifiers.usable(), 15.0)
                placed = gateway.metrics.replica_requests
                before = placed.value(role="verifier", replica=victim)
                assert wait_until(lambda: placed.value(role="verifier", replica=victim) > before, 15.0)
            finally:
                load.stop()
            assert load.errors == []
            assert all(output == expected[text] for text, output in load.outputs)
            assert len(load.outputs) >= 3 * CLIENTS
            assert gateway.metrics.failovers.value(role="verifier") >= 1  # requests moved mid-request
    finally:
        for proc in verifiers:
            proc.kill()
            proc.wait(10)


class _Load:
    """CLIENTS threads sending requests (Generate and GenerateStream, GAD and AR) until stopped."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.outputs: list[tuple[str, list[int]]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def done(self) -> int:
        with self._lock:
            return len(self.outputs) + len(self.errors)

    def _client(self, index: int) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            n = index
            while not self._stop.is_set():
                text, overrides = TEXTS[n % len(TEXTS)], MODES[n % len(MODES)]
                request = gateway_pb2.GenerateRequest(text=text, config=overrides_to_wire(overrides))
                metadata = (("x-client-id", f"client-{index}"),)
                try:
                    if n % 2:
                        ids = list(stub.Generate(request, timeout=60, metadata=metadata).output_ids)
                    else:
                        chunks = stub.GenerateStream(request, timeout=60, metadata=metadata)
                        ids = [i for chunk in chunks for i in chunk.output_ids]
                except grpc.RpcError as exc:
                    with self._lock:
                        self.errors.append(f"{exc.code().name}: {exc.details()}")
                else:
                    with self._lock:
                        self.outputs.append((text, ids))
                n += 1
