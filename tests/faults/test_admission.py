"""Admission control under overload (issue items 3, 4 and 9): racing opens never pass a server's
`max_sessions`; the gateway's own beam requests never meet the verifier's RESOURCE_EXHAUSTED (they
wait in the gateway's bounded queue, or the gateway itself refuses them); a flooding client does
not starve a well-behaved one; idle session streams are ended and free their slot.

Real servers on loopback (`ServiceStack` with small limits); every loop is bounded in count and
time. The figures these tests measure are in RELIABILITY.md ("Admission control and overload").
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos.specdec.v1 import drafter_pb2, gateway_pb2, verifier_pb2
from protos.specdec.v1 import drafter_pb2_grpc as drafter_rpc
from protos.specdec.v1 import gateway_pb2_grpc as gateway_rpc
from protos.specdec.v1 import verifier_pb2_grpc as verifier_rpc
from specdec.serve import ServiceStack
from tests.services.conftest import wait_until

CAP = 8  # max_sessions of the servers under racing opens
OPENS = 120  # simultaneous opens against it
IDLE_S = 0.5
SOURCE = [5, 6, 7, 8]


def _sections(**gateway) -> dict:
    return {
        "verifier": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", "max_sessions": CAP},
        "drafter": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", "max_sessions": CAP},
        "gateway": {"address": "127.0.0.1:0", **gateway},
    }


def _metric(server, name: str) -> float:
    """A metric from the server's Prometheus endpoint (what an operator sees), summed over its labels."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.host.metrics_port}/metrics", timeout=5).read().decode()
    samples = [line.rpartition(" ") for line in text.splitlines() if not line.startswith("#")]
    return sum(float(value) for key, _, value in samples if key.partition("{")[0] == f"specdec_{name}")



# ---- (a) racing opens -------------------------------------------------------------------------


def _open_message(role: str):
    if role == "verifier":
        return verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=SOURCE))
    return drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(source_ids=SOURCE, seed=0))


def _race(address: str, role: str, n: int) -> tuple[int, int, list[str]]:
    """`n` streams opened at once (threads released by one barrier); every admitted one is held
    until all have answered, so the admitted count is the number the server let in at the same
    time. (opened, refused, other outcomes).

    The synchronous client, because grpc.aio's client can report a refusal that races its own
    write as INTERNAL "Internal error from Core" (grpc/grpc#36066), which would blur the count."""
    barrier = threading.Barrier(n, timeout=30)
    all_answered = threading.Event()
    lock = threading.Lock()
    outcomes: list[str] = []

    def one(channel: grpc.Channel) -> None:
        if role == "verifier":
            method = verifier_rpc.VerifierServiceStub(channel).Verify
        else:
            method = drafter_rpc.DrafterServiceStub(channel).Draft

        def requests():
            yield _open_message(role)
            all_answered.wait(30)

        barrier.wait()
        call = method(requests(), timeout=30)
        try:
            outcome = next(call).WhichOneof("kind")
        except grpc.RpcError as exc:
            code = exc.code()
            outcome = "refused" if code == grpc.StatusCode.RESOURCE_EXHAUSTED else f"{code.name} {exc.details()}"
        with lock:
            outcomes.append(outcome)
            if len(outcomes) == n:
                all_answered.set()
        all_answered.wait(30)
        call.cancel()

    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(n) as pool:
        for future in [pool.submit(one, channel) for _ in range(n)]:
            future.result(60)
    opened = outcomes.count("opened")
    refused = outcomes.count("refused")
    return opened, refused, [o for o in outcomes if o not in ("opened", "refused")]


@pytest.fixture(scope="module")
def capped(bundle_dir):
    with ServiceStack("all", bundle_dir, _sections()) as stack:
        yield stack.running


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_racing_opens_never_pass_max_sessions(capped, role):
    server = getattr(capped, role)
    rejected_before = _metric(server, f"{role}_rejected_total")
    opened, refused, others = _race(capped.addresses[role], role, OPENS)
    assert (opened, refused, others) == (CAP, OPENS - CAP, []), others
    assert _metric(server, f"{role}_peak_sessions") == CAP
    assert _metric(server, f"{role}_rejected_total") - rejected_before == OPENS - CAP
    assert wait_until(lambda: server.active_sessions == 0)
    assert server.streams.admitted == 0  # every slot given back


# ---- (b) the gateway's beam requests against a small verifier budget --------------------------


def _generate(stub, request: gateway_pb2.GenerateRequest, client: str, timeout: float = 30.0) -> tuple[str, str]:
    try:
        stub.Generate(request, timeout=timeout, metadata=(("x-client-id", client),))
        return "OK", ""
    except grpc.RpcError as exc:
        return exc.code().name, exc.details()


BEAM = gateway_pb2.GenerateRequest(
    input_ids=SOURCE, config=gateway_pb2.DecodingConfig(mode=gateway_pb2.MODE_AR_BEAM, num_beams=4, max_new_tokens=24)
)


@pytest.mark.parametrize("max_queued", [64, 2])
def test_beam_requests_never_meet_the_verifiers_refusal(bundle_dir, max_queued):
    """12 concurrent beam-4 requests against 8 verifier sessions: 2 run at a time. With a deep
    queue all 12 are answered; with a queue of 2 the rest are refused by the gateway itself."""
    n = 12
    with ServiceStack("all", bundle_dir, _sections(max_queued=max_queued, max_per_client=n)) as stack:
        running = stack.running
        with grpc.insecure_channel(running.addresses["gateway"]) as channel:
            stub = gateway_rpc.GatewayServiceStub(channel)
            with ThreadPoolExecutor(n) as pool:
                results = list(pool.map(lambda _: _generate(stub, BEAM, "beam"), range(n)))
        assert _metric(running.verifier, "verifier_rejected_total") == 0
        assert _metric(running.verifier, "verifier_peak_sessions") <= CAP
        codes = [code for code, _ in results]
        refused = [details for code, details in results if code != "OK"]
        assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, results
        assert all(d.startswith("gateway overloaded:") for d in refused), refused
        if max_queued >= n:
            assert codes == ["OK"] * n
        else:
            assert codes.count("OK") >= 2 + max_queued  # the first four arrivals run or wait


# ---- (c) a flood does not starve a well-behaved client ----------------------------------------


def test_a_flooding_client_does_not_starve_a_well_behaved_one(bundle_dir):
    flood_n, flood_s, good_n, bound_s = 48, 8.0, 10, 5.0
    sections = _sections(workers=8, max_queued=16, max_per_client=4)
    sections["verifier"]["max_sessions"] = 4
    ar = gateway_pb2.GenerateRequest(
        input_ids=SOURCE, config=gateway_pb2.DecodingConfig(mode=gateway_pb2.MODE_AR_GREEDY, max_new_tokens=32)
    )
    with (
        ServiceStack("all", bundle_dir, sections) as stack,
        grpc.insecure_channel(stack.running.addresses["gateway"]) as channel,
    ):
        stub = gateway_rpc.GatewayServiceStub(channel)
        stop = threading.Event()
        flood: list[str] = []

        def flooder() -> None:
            end = time.monotonic() + flood_s
            for _ in range(200):  # bounded in count as well as in time
                if stop.is_set() or time.monotonic() >= end:
                    break
                flood.append(_generate(stub, ar, "flood", timeout=10)[0])

        good: list[tuple[str, float]] = []
        with ThreadPoolExecutor(flood_n) as pool:
            for _ in range(flood_n):
                pool.submit(flooder)
            time.sleep(0.5)  # the flood is on
            try:
                for _ in range(good_n):
                    t0 = time.monotonic()
                    code, details = _generate(stub, ar, "good", timeout=bound_s)
                    good.append((code if code == "OK" else f"{code} {details}", time.monotonic() - t0))
            finally:
                stop.set()
    assert [code for code, _ in good] == ["OK"] * good_n
    assert max(s for _, s in good) < bound_s
    assert "RESOURCE_EXHAUSTED" in flood  # the flood met the gateway's per-client cap ...
    assert set(flood) <= {"OK", "RESOURCE_EXHAUSTED"}  # ... and nothing else


# ---- (d) idle sessions -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def idle_limited(bundle_dir):
    sections = _sections()
    sections["verifier"]["session_idle_s"] = IDLE_S
    sections["drafter"]["session_idle_s"] = IDLE_S
    with ServiceStack("all", bundle_dir, sections) as stack:
        yield stack.running


async def _idle(address: str, role: str, send_open: bool) -> tuple[grpc.StatusCode, str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        if role == "verifier":
            call = verifier_rpc.VerifierServiceStub(channel).Verify(timeout=30)
        else:
            call = drafter_rpc.DrafterServiceStub(channel).Draft(timeout=30)
        t0 = time.monotonic()
        if send_open:
            await call.write(_open_message(role))
            assert (await call.read()).WhichOneof("kind") == "opened"
        # Then nothing: the server must end the stream by itself.
        code = await asyncio.wait_for(call.code(), 10)
        return code, await call.details(), time.monotonic() - t0


@pytest.mark.parametrize("send_open", [True, False], ids=["after-open", "before-open"])
@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_idle_sessions_are_ended_and_free_their_slot(idle_limited, role, send_open):
    server = getattr(idle_limited, role)
    code, details, took = asyncio.run(_idle(idle_limited.addresses[role], role, send_open))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
    assert details == f"no message for {IDLE_S:g} s: the idle {role} session is closed"
    assert IDLE_S <= took < IDLE_S + 5.0
    assert wait_until(lambda: server.active_sessions == 0 and server.streams.admitted == 0)
