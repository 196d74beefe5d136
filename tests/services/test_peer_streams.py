"""The gateway's grpc.aio peer streams (gateway/peers/streams.py) driven from worker threads, against
real verifier and drafter servers on loopback: the same outputs as the synchronous streams, no
thread per stream, and every behaviour of `gateway.peers.remote` (cancellation mid-step, deadlines
against the drafter's own cap, a peer dying, the peer's session freed when the stream ends).

A stopped (SIGSTOP) server is how a step is made to hang: the client's call is open and nothing
answers it, exactly as with a stuck forward.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

import grpc
import pytest

from core.errors import SpecdecError, StatusCode
from decoding.config import DecodingConfig
from decoding.decode import decode
from gateway.config import GatewayConfig
from gateway.peers.remote import (
    CallOptions,
    Cancellation,
    DrafterFailure,
    RemoteDrafter,
    RemoteVerifier,
    RequestCancelled,
    RequestDeadlineExceeded,
    fetch_drafter_info,
    fetch_verifier_info,
)
from gateway.peers.streams import PeerChannel
from serving.channels import channel_options
from tests.faults.servers import Served, write_config
from tests.services.conftest import wait_until

SOURCES = [[7, 8, 9, 10, 11], [12, 13, 12, 13, 14, 15, 16], [20, 21, 22]]
HANG_S = 0.3  # how long a step is left hanging before it is cancelled or its deadline passes


@pytest.fixture(scope="module")
def loop():
    """An event loop on a thread of its own, as the gateway's (the test's thread is the worker)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def on_loop(loop, coro, timeout: float = 30.0):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)


def peer_channel(loop, address: str) -> PeerChannel:
    async def make() -> PeerChannel:
        return PeerChannel(address, None, channel_options())

    return on_loop(loop, make())


@pytest.fixture(scope="module")
def peers(stack, loop):
    """(verifier, drafter) factories over aio channels to the shared stack, and the sync pair."""
    addresses = stack.running.addresses
    v_channel, d_channel = peer_channel(loop, addresses["verifier"]), peer_channel(loop, addresses["drafter"])
    with grpc.insecure_channel(addresses["verifier"]) as v_sync, grpc.insecure_channel(addresses["drafter"]) as d_sync:
        v_info, d_info = fetch_verifier_info(v_sync), fetch_drafter_info(d_sync)
        pairs = {"aio": (v_channel, d_channel), "sync": (v_sync, d_sync)}
        yield {
            path: (lambda o=None, v=v: RemoteVerifier(v, v_info, o), lambda o=None, d=d: RemoteDrafter(d, d_info, o))
            for path, (v, d) in pairs.items()
        }
    on_loop(loop, v_channel.close())
    on_loop(loop, d_channel.close())


@pytest.mark.parametrize("mode", ["ar", "gad", "gad++", "iad", "mjsd"])
def test_aio_streams_decode_as_the_sync_streams(peers, mode):
    """Token for token the same as the synchronous streams, on the same servers; GAD equals AR."""
    config = DecodingConfig().with_overrides({"mode": mode, "max_new_tokens": 24})
    ar = DecodingConfig().with_overrides({"mode": "ar", "max_new_tokens": 24})
    (verifier, drafter), (sync_verifier, sync_drafter) = peers["aio"], peers["sync"]
    for source in SOURCES:
        aio = decode(source, config, verifier(), drafter())
        sync = decode(source, config, sync_verifier(), sync_drafter())
        assert aio.output_ids == sync.output_ids
        assert aio.stats.iterations == sync.stats.iterations
        if mode in ("gad", "iad"):
            assert aio.output_ids == decode(source, ar, verifier(), None).output_ids


def test_no_thread_per_stream(peers):
    """Twenty sessions open at once, each mid-request, hold no thread of their own (the synchronous
    streams hold one each, which is what this checks the test can see)."""
    counts = {}
    for path in ("aio", "sync"):
        make_verifier, _ = peers[path]
        before = threading.active_count()
        sessions = [make_verifier().open(source) for source in (SOURCES * 7)[:20]]
        for s in sessions:
            s.step(0, [], [], 1)
        counts[path] = threading.active_count() - before
        for s in sessions:
            s.close()
    assert counts["sync"] >= 20  # the old path: one consumer thread per stream
    assert counts["aio"] <= 2


def test_closing_frees_the_peer_session(stack, peers):
    make_verifier, _ = peers["aio"]
    verifier_server = stack.running.verifier
    assert wait_until(lambda: verifier_server.active_sessions == 0, 5.0), verifier_server.active_sessions
    before = 0
    sessions = [make_verifier().open(source) for source in SOURCES]
    for s in sessions:
        s.step(0, [], [], 1)
    assert verifier_server.active_sessions == before + len(SOURCES)  # added before `opened` is answered
    for s in sessions:
        s.close()
    assert wait_until(lambda: verifier_server.active_sessions == before, 5.0)


def test_the_gateway_drives_its_peer_streams_on_grpc_aio(stack):
    """The gateway's verifier and drafter session streams are grpc.aio calls on its own loop."""
    gateway = stack.running.gateway
    replicas = [*gateway.verifiers.replicas.replicas.values(), *gateway.drafters.replicas.replicas.values()]
    assert len(replicas) == 2 and all(isinstance(r.channel, PeerChannel) for r in replicas)
    assert "peer_streams" not in {f.name for f in fields(GatewayConfig)}  # no longer a setting


# ---- faults, on servers of their own ----------------------------------------------------------


@pytest.fixture(scope="module")
def own(bundle_dir, tmp_path_factory, loop):
    """A verifier and a drafter as processes of their own (signals stop and kill them), with aio
    channels to both."""
    tmp = tmp_path_factory.mktemp("peer-streams")
    config = tmp / "specdec.toml"
    ports = write_config(config)
    served = {role: Served(role, bundle_dir, config, *ports[role]) for role in ("verifier", "drafter")}
    try:
        for s in served.values():
            s.wait_ready()
        channels = {role: peer_channel(loop, s.address) for role, s in served.items()}
        with grpc.insecure_channel(served["verifier"].address) as v, grpc.insecure_channel(
            served["drafter"].address
        ) as d:
            infos = {"verifier": fetch_verifier_info(v), "drafter": fetch_drafter_info(d)}
        yield served, channels, infos
        for channel in channels.values():
            on_loop(loop, channel.close())
    finally:
        for s in served.values():
            s.kill()


def _stopped(served: Served):
    """Context: the server stopped (SIGSTOP) inside, running again after."""

    class Stopped:
        def __enter__(self):
            served.signal(signal.SIGSTOP)

        def __exit__(self, *exc):
            served.signal(signal.SIGCONT)

    return Stopped()


def test_cancel_returns_a_hanging_step_at_once_and_frees_the_session(own):
    served, channels, infos = own
    cancellation = Cancellation()
    session = RemoteVerifier(channels["verifier"], infos["verifier"], CallOptions(cancellation=cancellation)).open(
        SOURCES[0]
    )
    session.step(0, [], [], 1)
    with _stopped(served["verifier"]), ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        future = pool.submit(session.step, 1, [9], [], 1)
        time.sleep(HANG_S)
        assert not future.done()  # really hanging on the stopped server
        cancellation.cancel()
        with pytest.raises(RequestCancelled):
            future.result(timeout=2.0)
        assert time.monotonic() - started < HANG_S + 0.5
    with pytest.raises(RequestCancelled):  # a later step of the cancelled request fails at once too
        session.step(1, [9], [], 1)
    session.close()
    assert wait_until(lambda: served["verifier"].metric("specdec_verifier_active_sessions") == 0, 10.0)


def test_cancelled_before_open_opens_nothing(own):
    served, channels, infos = own
    opened = {role: served[role].metric(f"specdec_{role}_sessions_total") for role in served}
    cancellation = Cancellation()
    cancellation.cancel()
    with pytest.raises(RequestCancelled):
        RemoteVerifier(channels["verifier"], infos["verifier"], CallOptions(cancellation=cancellation)).open([5])
    with pytest.raises(RequestCancelled):
        RemoteDrafter(channels["drafter"], infos["drafter"], CallOptions(cancellation=cancellation)).open([5])
    # A live session opened after them reaches the servers, so the refused ones would have too.
    for role, make in (("verifier", RemoteVerifier), ("drafter", RemoteDrafter)):
        session = make(channels[role], infos[role]).open([5])
        session.step(0, [], [], 1) if role == "verifier" else session.draft_block(0, [], 2)
        session.close()
        assert wait_until(lambda r=role: served[r].metric(f"specdec_{r}_sessions_total") == opened[r] + 1, 5.0)


def test_request_deadline_is_the_requests_and_the_drafter_cap_is_a_drafter_failure(own):
    served, channels, infos = own
    options = CallOptions(deadline=time.monotonic() + 2 * HANG_S)
    session = RemoteVerifier(channels["verifier"], infos["verifier"], options).open(SOURCES[1])
    session.step(0, [], [], 1)
    with _stopped(served["verifier"]):
        started = time.monotonic()
        with pytest.raises(RequestDeadlineExceeded):
            session.step(1, [9], [], 1)
        assert time.monotonic() - started < 2 * HANG_S + 1.0
    session.close()

    # The drafter's own cap, shorter than the request's deadline: a DrafterFailure (fall back).
    far = CallOptions(deadline=time.monotonic() + 30.0)
    drafter = RemoteDrafter(channels["drafter"], infos["drafter"], far, timeout_cap=HANG_S)
    d_session = drafter.open(SOURCES[1])
    with _stopped(served["drafter"]), pytest.raises(DrafterFailure):
        d_session.draft_block(0, [], 4)
    d_session.close()

    # The request's deadline reached while waiting for the drafter: the request's, not a failure.
    near = CallOptions(deadline=time.monotonic() + HANG_S)
    d_session = RemoteDrafter(channels["drafter"], infos["drafter"], near, timeout_cap=30.0).open(SOURCES[1])
    with _stopped(served["drafter"]), pytest.raises(RequestDeadlineExceeded):
        d_session.draft_block(0, [], 4)
    d_session.close()


def test_a_peer_dying_mid_request_is_unavailable(own):
    """Last in this module: it kills the servers."""
    served, channels, infos = own
    session = RemoteVerifier(channels["verifier"], infos["verifier"]).open(SOURCES[2])
    session.step(0, [], [], 1)
    d_session = RemoteDrafter(channels["drafter"], infos["drafter"]).open(SOURCES[2])
    d_session.draft_block(0, [], 4)
    served["verifier"].kill()
    served["drafter"].kill()
    with pytest.raises(SpecdecError) as err:
        session.step(1, [9], [], 1)
    assert err.value.code == StatusCode.UNAVAILABLE
    with pytest.raises(DrafterFailure):
        d_session.draft_block(1, [9], 4)
    session.close()
    d_session.close()
