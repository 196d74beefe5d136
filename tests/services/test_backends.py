"""The verifier and drafter services run on either backend, chosen by config; GAD stays identical
to greedy."""

from __future__ import annotations

import grpc
import pytest

from core.backends import DEFAULT_BACKEND
from core.backends import DEFAULT_BACKEND as DEFAULT_DRAFTER_BACKEND
from decoding.config import Mode
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from specdec.serve import ServiceStack
from tests.services.conftest import drafter_info, verifier_info

TEXT = "We have been living in this city."


# How the drafter service names its backends: both drafters run on the one backend.
DRAFTER_BACKEND_NAMES = {"torch": "torch-cpu", "onnxruntime": "onnxruntime-cpu"}


def test_default_backends_are_reported(stack):
    assert verifier_info(stack.running.addresses["verifier"]).backend == f"{DEFAULT_BACKEND}-cpu"
    assert drafter_info(stack.running.addresses["drafter"]).backend == DRAFTER_BACKEND_NAMES[DEFAULT_DRAFTER_BACKEND]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_gad_equals_greedy_through_each_backend(bundle_dir, backend):
    sections = {
        "verifier": {"address": "127.0.0.1:0", "backend": backend},
        "drafter": {"address": "127.0.0.1:0", "backend": backend},
        "gateway": {"address": "127.0.0.1:0"},
    }
    with ServiceStack("all", bundle_dir, sections) as running:
        addresses = running.running.addresses
        assert verifier_info(addresses["verifier"]).backend == f"{backend}-cpu"
        assert drafter_info(addresses["drafter"]).backend == DRAFTER_BACKEND_NAMES[backend]
        with grpc.insecure_channel(addresses["gateway"]) as channel:
            gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
            outputs = {}
            for mode in (Mode.AR, Mode.GAD):
                overrides = {"mode": mode.value, "max_new_tokens": 30, **({"k": 5} if mode == Mode.GAD else {})}
                request = gateway_pb2.GenerateRequest(text=TEXT, config=overrides_to_wire(overrides))
                outputs[mode] = list(gateway.Generate(request, timeout=60).output_ids)
    assert outputs[Mode.GAD] == outputs[Mode.AR]
    assert len(outputs[Mode.AR]) > 0


def test_gad_asks_the_drafter_for_no_more_than_its_max_draft_len(bundle_dir):
    """GAD drafts a block one position longer than it verifies (the lookahead), except where the
    drafter's `max_draft_len` (its ModelInfo) allows no more: k at that limit never has a draft
    refused (a refusal would fall back to AR, `degraded`), with overlap and without."""
    sections = {
        "verifier": {"address": "127.0.0.1:0"},
        "drafter": {"address": "127.0.0.1:0", "max_draft_len": 5},
        "gateway": {"address": "127.0.0.1:0"},
    }
    with ServiceStack("all", bundle_dir, sections) as running, grpc.insecure_channel(
        running.running.addresses["gateway"]
    ) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)

        def generate(**overrides) -> gateway_pb2.GenerateResponse:
            config = overrides_to_wire({"max_new_tokens": 30, **overrides})
            return gateway.Generate(gateway_pb2.GenerateRequest(text=TEXT, config=config), timeout=60)

        greedy = list(generate(mode=Mode.AR.value).output_ids)
        for overlap in (False, True):
            gad = generate(mode=Mode.GAD.value, k=5, overlap=overlap)
            assert list(gad.output_ids) == greedy
            assert not gad.stats.degraded and gad.stats.drafted_tokens > 0, overlap
        # What a refused draft does: a block of 6 is past the limit, the request falls back to AR.
        refused = generate(mode=Mode.GAD.value, k=6)
        assert list(refused.output_ids) == greedy and refused.stats.degraded
