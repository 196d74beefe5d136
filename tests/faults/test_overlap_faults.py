"""A pre-draft in flight when the request is cancelled, or when the drafter dies, leaks nothing;
nor does a pre-verified draft (drafted on the same pool while the verifier steps).

Verifier and drafter are real servers on loopback (each its own stack, so the drafter can die
alone); the request runs `decode()` over `gateway.peers.remote`'s sessions with a cancel switch, as the
gateway's worker does. A recorder holds the pre-draft's drafter call open until the fault has
happened, so the fault always lands on a pre-draft in flight. Afterwards: the error is the one the
plain loop raises (`RequestCancelled`, `DrafterFailure`), no drafter call was in flight when the
session closed, and the servers hold no session of the request.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from gateway.peers import remote
from specdec.serve import ServiceStack
from tests.recording import Call, Record, RecordingDrafter
from tests.services.conftest import LOOPBACK, scrape, wait_until

SOURCE = list(range(5, 35))
CONFIG = DecodingConfig(mode=Mode.GAD, k=1, max_new_tokens=60, overlap=True, preverify=False)
PREVERIFIED = DecodingConfig(mode=Mode.GAD, k=1, max_new_tokens=60, overlap=False, preverify=True)
AHEAD = pytest.mark.parametrize("config", [CONFIG, PREVERIFIED], ids=["overlap", "preverify"])


@pytest.fixture
def verifier_stack(bundle_dir):
    with ServiceStack("verifier", bundle_dir, LOOPBACK) as stack:
        yield stack


@pytest.fixture
def drafter_stack(bundle_dir):
    stack = ServiceStack("drafter", bundle_dir, LOOPBACK).start()
    try:
        yield stack
    finally:
        if stack.running.drafter is not None:
            stack.stop(grace=0)


def _held_at_predraft(nth: int, fault_done: threading.Event, reached: threading.Event):
    """A hook that stops the `nth` pre-draft call until the test's fault has happened."""

    def hook(call: Call, record: Record) -> None:
        if call.predraft and len(record.on_predraft_thread()) == nth:
            reached.set()
            assert fault_done.wait(10), "the test never injected its fault"

    return hook


def _active(stack: ServiceStack, role: str) -> float:
    server = getattr(stack.running, role)
    return scrape(server.host.metrics_port).get(f"specdec_{role}_active_sessions", 0.0)


@AHEAD
def test_cancelling_a_request_with_a_pre_draft_in_flight_leaks_nothing(verifier_stack, drafter_stack, config):
    cancellation = remote.Cancellation()
    options = remote.CallOptions(request_id="overlap-cancel", cancellation=cancellation)
    reached, fault_done = threading.Event(), threading.Event()
    v_addr, d_addr = verifier_stack.running.addresses["verifier"], drafter_stack.running.addresses["drafter"]
    with grpc.insecure_channel(v_addr) as vc, grpc.insecure_channel(d_addr) as dc:
        verifier = remote.RemoteVerifier(vc, remote.fetch_verifier_info(vc), options)
        drafter = RecordingDrafter(remote.RemoteDrafter(dc, remote.fetch_drafter_info(dc), options),
                                   hook=_held_at_predraft(2, fault_done, reached))
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(decode, SOURCE, config, verifier, drafter)
            assert reached.wait(30), "no second pre-draft started"
            cancellation.cancel()
            fault_done.set()
            with pytest.raises(remote.RequestCancelled):
                running.result(30)
    (record,) = drafter.records
    assert record.closed and record.in_flight_at_close == 0 and record.most_in_flight == 1
    assert record.calls_after_close == 0
    assert wait_until(lambda: _active(drafter_stack, "drafter") == 0 and _active(verifier_stack, "verifier") == 0)


@AHEAD
def test_a_drafter_dying_during_a_pre_draft_fails_over_to_ar_and_leaks_nothing(verifier_stack, drafter_stack, config):
    reached, fault_done = threading.Event(), threading.Event()
    v_addr, d_addr = verifier_stack.running.addresses["verifier"], drafter_stack.running.addresses["drafter"]
    committed: list[int] = []
    with grpc.insecure_channel(v_addr) as vc, grpc.insecure_channel(d_addr) as dc:
        verifier = remote.RemoteVerifier(vc, remote.fetch_verifier_info(vc))
        drafter = RecordingDrafter(remote.RemoteDrafter(dc, remote.fetch_drafter_info(dc)),
                                   hook=_held_at_predraft(2, fault_done, reached))
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(decode, SOURCE, config, verifier, drafter, committed.extend)
            assert reached.wait(30), "no second pre-draft started"
            drafter_stack.stop(grace=0)  # the drafter dies with the pre-draft's call about to go out
            drafter_stack.running.drafter = None
            fault_done.set()
            with pytest.raises(remote.DrafterFailure):
                running.result(30)
        (record,) = drafter.records
        assert record.closed and record.in_flight_at_close == 0 and record.most_in_flight == 1
        assert wait_until(lambda: _active(verifier_stack, "verifier") == 0)
        # The gateway's fallback: AR from the committed prefix, through the same verifier, is greedy.
        ar = DecodingConfig(mode=Mode.AR, max_new_tokens=config.max_new_tokens)
        greedy = decode(SOURCE, ar, verifier, None).output_ids
        assert committed and committed == greedy[: len(committed)]
        assert decode(SOURCE, ar, verifier, None, prefix=committed).output_ids == greedy
