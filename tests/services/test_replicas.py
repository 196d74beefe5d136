"""Replica sets behind the gateway, with real servers on loopback (gateway.peers.replicas, gateway.peers.failover).

Two verifier and two drafter replicas: sessions spread over both under load and the lossless
output equals in-process greedy; a draining replica gets no new sessions; a replica serving
another bundle is refused; two gateways share the same replicas; a `dns://` name served by a
small DNS server on loopback is followed as its set of addresses changes. (A replica killed with
SIGKILL under load, and restarted: tests/faults/test_replica_failover.py.)
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import pytest

from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from seq2seq_models.bundle import make_tiny_bundle
from specdec.serve import ServiceStack
from tests.services.conftest import free_port, wait_until
from verifier_service.session import make_verifier

TEXTS = ["We have been living in this city.", "The weather is nice today.", "Where is the station?"]
GAD = {"mode": "gad", "k": 4, "max_new_tokens": 40, "seed": 1}
AR = {"mode": "ar", "max_new_tokens": 40, "seed": 1}
LOOP = {"address": "127.0.0.1:0"}


@pytest.fixture(scope="module")
def expected(bundle) -> dict[str, list[int]]:
    """In-process greedy output of every text: what every lossless request must answer."""
    verifier = make_verifier(bundle, "onnxruntime")
    config = DecodingConfig(mode=Mode.AR, max_new_tokens=GAD["max_new_tokens"])
    return {t: decode(bundle.tokenizer.encode(t), config, verifier, None).output_ids for t in TEXTS}


@pytest.fixture(scope="module")
def replicas(bundle_dir) -> Iterator[dict[str, list[ServiceStack]]]:
    """Two verifier and two drafter replicas, each a server of its own."""
    with ExitStack() as stack:
        yield {
            role: [stack.enter_context(ServiceStack(role, bundle_dir, {role: LOOP})) for _ in range(2)]
            for role in ("verifier", "drafter")
        }


def addresses(stacks: list[ServiceStack], role: str) -> str:
    return ",".join(s.running.addresses[role] for s in stacks)


@contextmanager
def gateway_over(bundle_dir: Path, verifiers: str, drafters: str = "", **keys) -> Iterator:
    """A gateway over the replicas named; yields its server object."""
    sections = {"gateway": {"address": "127.0.0.1:0", "verifier_address": verifiers, "drafter_address": drafters,
                            "resolve_interval_s": 0.2, **keys}}
    with ServiceStack("gateway", bundle_dir, sections) as stack:
        yield stack.running.gateway


def generate_all(gateway, overrides: dict, count: int, clients: int = 8) -> list[tuple[str, list[int]]]:
    """`count` requests from `clients` threads; (text, output) of each (a failed one raises)."""
    address = f"127.0.0.1:{gateway.host.port}"
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        def one(i: int) -> tuple[str, list[int]]:
            text = TEXTS[i % len(TEXTS)]
            request = gateway_pb2.GenerateRequest(text=text, config=overrides_to_wire(overrides))
            metadata = (("x-client-id", f"client-{i % clients}"),)
            return text, list(stub.Generate(request, timeout=60, metadata=metadata).output_ids)

        with ThreadPoolExecutor(clients) as pool:
            return list(pool.map(one, range(count)))


def placed(gateway, role: str, address: str) -> float:
    return gateway.metrics.replica_requests.value(role=role, replica=address)


def test_sessions_spread_over_both_replicas_and_outputs_stay_lossless(bundle_dir, replicas, expected):
    verifiers, drafters = replicas["verifier"], replicas["drafter"]
    opened_before = [v.running.verifier.streams.m_sessions.value() for v in verifiers]
    with gateway_over(bundle_dir, addresses(verifiers, "verifier"), addresses(drafters, "drafter")) as gateway:
        assert gateway.verifiers.usable() == sorted(addresses(verifiers, "verifier").split(","))
        results = generate_all(gateway, GAD, 24)
        assert all(output == expected[text] for text, output in results)
        for role, stacks in (("verifier", verifiers), ("drafter", drafters)):
            shares = [placed(gateway, role, s.running.addresses[role]) for s in stacks]
            assert sum(shares) == 24 and min(shares) >= 4, (role, shares)  # each serves a share
        assert gateway.metrics.failovers.value(role="verifier") == 0
        # The admission budget is both replicas' sessions together.
        assert gateway._budget().verifier_sessions == sum(v.running.verifier.model_info.max_sessions for v in verifiers)
    opened = [v.running.verifier.streams.m_sessions.value() - b for v, b in zip(verifiers, opened_before, strict=True)]
    assert min(opened) >= 4 and sum(opened) == 24  # the replicas saw the sessions the gateway placed


def test_two_gateways_share_the_same_replicas(bundle_dir, replicas, expected):
    verifiers, drafters = addresses(replicas["verifier"], "verifier"), addresses(replicas["drafter"], "drafter")
    with (
        gateway_over(bundle_dir, verifiers, drafters) as first,
        gateway_over(bundle_dir, verifiers, drafters) as second,
    ):
        results: dict[str, list] = {}
        threads = [threading.Thread(target=lambda g=g, n=n: results.__setitem__(n, generate_all(g, GAD, 12, 4)))
                   for g, n in ((first, "first"), (second, "second"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(results) == ["first", "second"]
        assert all(output == expected[text] for r in results.values() for text, output in r)
        for gateway in (first, second):
            assert all(placed(gateway, "verifier", a) > 0 for a in verifiers.split(","))


def test_a_draining_replica_gets_no_new_sessions(bundle_dir, replicas, expected):
    with ServiceStack("verifier", bundle_dir, {"verifier": LOOP}) as draining:
        kept = replicas["verifier"][0].running.addresses["verifier"]
        leaving = draining.running.addresses["verifier"]
        with gateway_over(bundle_dir, f"{kept},{leaving}") as gateway:
            assert gateway.verifiers.usable() == sorted([kept, leaving])
            # SIGTERM's first half: health NOT_SERVING, the listener still open (serving.host).
            draining.call(draining.running.verifier.host.begin_drain(5.0))
            assert wait_until(lambda: gateway.verifiers.usable() == [kept], 5.0)
            results = generate_all(gateway, AR, 8, 4)
            assert all(output == expected[text] for text, output in results)
            assert placed(gateway, "verifier", leaving) == 0
            assert gateway.metrics.replica_failures.value(role="verifier", replica=leaving) == 0
            assert placed(gateway, "verifier", kept) == 8


def test_a_replica_serving_another_bundle_is_refused(bundle_dir, replicas, expected, tmp_path):
    """The first replica accepted sets the bundle; one that comes up later with another is refused."""
    other = make_tiny_bundle(tmp_path / "other", seed=4)
    kept = replicas["verifier"][0].running.addresses["verifier"]
    refused = f"127.0.0.1:{free_port()}"
    with gateway_over(bundle_dir, f"{kept},{refused}") as gateway:
        assert gateway.verifiers.usable() == [kept]
        with ServiceStack("verifier", other, {"verifier": {"address": refused}}):
            by_address = gateway.verifiers.replicas.replicas
            assert wait_until(lambda: by_address[refused].refused is not None, 10.0)
            assert "serves bundle" in by_address[refused].refused
            results = generate_all(gateway, AR, 4, 2)
            assert all(output == expected[text] for text, output in results)
            assert placed(gateway, "verifier", refused) == 0
            assert gateway.verifiers.usable() == [kept]


def test_a_dns_name_is_followed_as_its_addresses_change(bundle_dir, expected):
    dnslib_server = pytest.importorskip("dnslib.server")
    # Two replicas on one port, on two loopback addresses: what a name with two A records points to.
    port = free_port()
    with ExitStack() as stack:
        for host in ("127.0.0.2", "127.0.0.1"):
            stack.enter_context(ServiceStack("verifier", bundle_dir, {"verifier": {"address": f"{host}:{port}"}}))
        dns = stack.enter_context(_dns_server(dnslib_server, ["127.0.0.1"]))
        name = f"dns://127.0.0.1:{dns.port}/verifiers.test:{port}"
        one, two = f"127.0.0.1:{port}", f"127.0.0.2:{port}"
        with gateway_over(bundle_dir, name) as gateway:
            assert gateway.verifiers.usable() == [one]
            dns.records[:] = ["127.0.0.1", "127.0.0.2"]  # a replica appears
            assert wait_until(lambda: gateway.verifiers.usable() == [one, two], 10.0)
            generate_all(gateway, AR, 8, 4)
            assert placed(gateway, "verifier", two) > 0 and placed(gateway, "verifier", one) > 0
            dns.records[:] = ["127.0.0.2"]  # one goes away
            assert wait_until(lambda: gateway.verifiers.usable() == [two], 10.0)
            before = placed(gateway, "verifier", one)
            results = generate_all(gateway, AR, 4, 2)
            assert all(output == expected[text] for text, output in results)
            assert placed(gateway, "verifier", one) == before


@contextmanager
def _dns_server(dnslib_server, records: list[str]) -> Iterator:
    """A DNS server on 127.0.0.1 answering every A question with `records` (changed in place)."""
    from dnslib import QTYPE, RR, A

    class Resolver(dnslib_server.BaseResolver):
        def __init__(self) -> None:
            self.records = list(records)
            self.port = 0

        def resolve(self, request, handler):
            reply = request.reply()
            if request.q.qtype == QTYPE.A:
                for ip in list(self.records):
                    reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(ip), ttl=0))
            return reply

    resolver = Resolver()
    server = dnslib_server.DNSServer(resolver, port=0, address="127.0.0.1", logger=_Quiet())
    server.start_thread()
    resolver.port = server.server.server_address[1]
    try:
        yield resolver
    finally:
        server.stop()


class _Quiet:
    """dnslib's logger, silenced (it prints every query)."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def test_a_drafter_replica_failing_mid_request_moves_the_request_to_the_other(bundle_dir, bundle, replicas):
    """Four long GAD streams over two drafter replicas; the one holding sessions stops at once (no
    grace): its requests go on with the other drafter, not degraded, and lossless."""
    long = {"mode": "gad", "k": 4, "max_new_tokens": 200, "seed": 1}
    verifier = make_verifier(bundle, "onnxruntime")
    config = DecodingConfig(mode=Mode.AR, max_new_tokens=200)
    expected = {t: decode(bundle.tokenizer.encode(t), config, verifier, None).output_ids for t in TEXTS}
    drafters = [ServiceStack("drafter", bundle_dir, {"drafter": LOOP}).start() for _ in range(2)]
    running = list(drafters)
    try:
        listed = addresses(drafters, "drafter")
        with (
            gateway_over(bundle_dir, addresses(replicas["verifier"], "verifier"), listed) as gateway,
            grpc.insecure_channel(f"127.0.0.1:{gateway.host.port}") as channel,
        ):
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            texts = [TEXTS[i % len(TEXTS)] for i in range(4)]
            calls = [stub.GenerateStream(gateway_pb2.GenerateRequest(text=t, config=overrides_to_wire(long)),
                                         timeout=60) for t in texts]
            chunks = [[next(call)] for call in calls]  # every request is decoding with a drafter
            held = {d: gateway.metrics.replica_sessions.value(role="drafter", replica=d.running.addresses["drafter"])
                    for d in drafters}
            victim = max(held, key=held.get)
            assert held[victim] > 0
            running.remove(victim)
            victim.stop(grace=0.0)  # its streams end at once
            for got, call in zip(chunks, calls, strict=True):
                got += list(call)
            for text, got in zip(texts, chunks, strict=True):
                assert [i for c in got for i in c.output_ids] == expected[text]
                assert not got[-1].stats.degraded
            assert gateway.metrics.failovers.value(role="drafter") >= 1
            assert gateway.metrics.degraded.value() == 0
    finally:
        for d in running:
            d.stop()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("127.0.0.1:50052,", "[gateway] verifier_address: empty address in '127.0.0.1:50052,'"),
        ("dns:///verifiers", "[gateway] verifier_address: 'dns:///verifiers': expected dns:///HOST:PORT"),
    ],
)
def test_a_malformed_replica_address_is_an_error_naming_the_key(value: str, message: str):
    from gateway.config import gateway_config

    with pytest.raises(ValueError) as raised:
        gateway_config({"gateway": {"verifier_address": value}})
    assert str(raised.value).startswith(message)


def test_the_replica_flags_take_a_list():
    from specdec.commands.flags import addresses_arg

    assert addresses_arg("10.0.0.1:50052,10.0.0.2:50052") == "10.0.0.1:50052,10.0.0.2:50052"
    assert addresses_arg("dns:///specdec-verifier:50052") == "dns:///specdec-verifier:50052"
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        addresses_arg("10.0.0.1:50052,10.0.0.2")
    assert str(raised.value).startswith("'10.0.0.2' is not HOST:PORT")
