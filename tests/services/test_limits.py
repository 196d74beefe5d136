"""Admission control: a verifier or drafter started with max_sessions=N holds N streams open,
refuses the next one with RESOURCE_EXHAUSTED, and admits again as soon as one closes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import pytest

from protos.specdec.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.serve import ServiceStack
from tests.services.conftest import wait_until

MAX_SESSIONS = 2


@pytest.fixture(scope="module")
def limited(bundle_dir):
    sections = {
        "verifier": {"address": "127.0.0.1:0", "max_sessions": MAX_SESSIONS},
        "drafter": {"address": "127.0.0.1:0", "max_sessions": MAX_SESSIONS},
        "gateway": {"address": "127.0.0.1:0"},
    }
    with ServiceStack("all", bundle_dir, sections) as running:
        yield running.running


class _Held:
    """One stream opened with a real `open` message and kept open until `close()`."""

    def __init__(self, start: Callable[[Iterator], Iterator], open_message) -> None:
        self._gate = threading.Event()

        def requests():
            yield open_message
            self._gate.wait(30)

        self.call = start(requests())
        try:
            self.first = next(self.call)  # the `opened` answer, or the refusal
        except grpc.RpcError:
            self._gate.set()
            raise

    def close(self) -> None:
        self.call.cancel()
        self._gate.set()


def _opener(role: str, channel: grpc.Channel) -> Callable[[], _Held]:
    if role == "verifier":
        verify = verifier_pb2_grpc.VerifierServiceStub(channel).Verify
        message = verifier_pb2.VerifyRequest(open=verifier_pb2.VerifyOpen(source_ids=[5, 6, 7]))
        return lambda: _Held(lambda it: verify(it, timeout=60), message)
    draft = drafter_pb2_grpc.DrafterServiceStub(channel).Draft
    message = drafter_pb2.DraftRequest(open=drafter_pb2.DraftOpen(source_ids=[5, 6, 7]))
    return lambda: _Held(lambda it: draft(it, timeout=60), message)


@pytest.mark.parametrize("role", ["verifier", "drafter"])
def test_max_sessions_refuses_one_more_then_admits_after_a_close(limited, role):
    server = getattr(limited, role)
    held: list[_Held] = []
    with grpc.insecure_channel(limited.addresses[role]) as channel:
        open_stream = _opener(role, channel)
        try:
            for _ in range(MAX_SESSIONS):
                held.append(open_stream())
                assert held[-1].first.WhichOneof("kind") == "opened"
            assert server.active_sessions == MAX_SESSIONS

            with pytest.raises(grpc.RpcError) as info:
                open_stream()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
            assert str(MAX_SESSIONS) in info.value.details()
            assert server.active_sessions == MAX_SESSIONS  # the refusal took no slot

            held.pop(0).close()
            assert wait_until(lambda: server.active_sessions == MAX_SESSIONS - 1)
            held.append(open_stream())  # admitted again
            assert held[-1].first.WhichOneof("kind") == "opened"
            assert server.active_sessions == MAX_SESSIONS
        finally:
            for stream in held:
                stream.close()
    assert wait_until(lambda: server.active_sessions == 0)
