"""Outputs under concurrent load with cancellations: a real `serve all` (tiny bundle, batching on
with the services' default keys) answers a burst of mixed requests (AR, IAD, GAD, adaptive GAD,
beam 3; unary and streaming) sent at once, while a few long requests are cancelled mid-decode
(client cancel of a stream and of a unary call, a short deadline). Every request that was not
cancelled equals the in-process, unbatched decode of its input: AR greedy for the lossless modes,
in-process beam search for beam. The verifier's metrics prove the burst really ran batched, and
once it is over neither model service holds a session."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.modes import MODES as MODE_SPECS
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from specdec.serve import ServiceStack
from tests.services.conftest import scrape, wait_until

TEXTS = ["hello world", "another line of text", "шо там", "a b c d e f", "We have been living here."]
MAX_NEW = 32
MODES: dict[str, dict[str, Any]] = {
    "ar": {"mode": "ar"},
    "iad": {"mode": "iad", "k": 8},
    "gad": {"mode": "gad", "k": 4},
    "gad-adaptive": {"mode": "gad", "k": 6, "adaptive": True},
    "beam": {"mode": "beam", "num_beams": 3},
}
# A long request (about 200 source tokens, the longest output): still decoding when it is cancelled.
LONG_IDS = [10 + (i * 7) % 140 for i in range(200)]
LONG_CONFIG = {"mode": "gad", "k": 4, "max_new_tokens": 255}
CANCEL_AFTER_S = 0.15


@dataclass(frozen=True)
class Job:
    kind: str  # "stream", "unary", or a cancellation: "cancel-stream", "cancel-unary", "deadline"
    mode: str
    text: str


@pytest.fixture(scope="module")
def served(bundle_dir):
    sections = {
        # Room for the whole burst at once: no request waits in the gateway's queue.
        "gateway": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", "drafter_retry_s": 0.2,
                    "workers": 40, "max_queued": 64, "max_per_client": 64},
        "verifier": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", "max_sessions": 128},
        "drafter": {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0", "max_sessions": 128},
    }
    with ServiceStack("all", bundle_dir, sections) as stack:
        yield stack


@pytest.fixture(scope="module")
def expected(bundle):
    """What each (mode, text) decodes to in-process, one request at a time, without batching."""
    from core.backends import DEFAULT_BACKEND
    from drafter_service.session import make_drafter
    from verifier_service.session import make_verifier

    verifier = make_verifier(bundle, DEFAULT_BACKEND)
    drafter = make_drafter(bundle, DEFAULT_BACKEND)
    greedy = DecodingConfig().with_overrides({"mode": "ar", "max_new_tokens": MAX_NEW})
    beam = DecodingConfig().with_overrides({**MODES["beam"], "max_new_tokens": MAX_NEW})
    out = {}
    for text in TEXTS:
        ids = bundle.tokenizer.encode(text)
        out[("greedy", text)] = decode(ids, greedy, verifier, drafter).output_ids
        out[("beam", text)] = decode(ids, beam, verifier, drafter).output_ids
    return out


def _jobs() -> list[Job]:
    jobs = [Job("stream" if (m + t) % 2 else "unary", mode, text)
            for m, mode in enumerate(MODES) for t, text in enumerate(TEXTS)]
    jobs += [Job("cancel-stream", "gad", ""), Job("cancel-stream", "iad", ""), Job("cancel-unary", "ar", ""),
             Job("deadline", "gad", "")]
    return jobs


def _run(stub, job: Job, start: threading.Barrier) -> tuple[str, list[int]]:
    """(status name, output ids) of one job; a cancelled job's output is what it got before the cancel."""
    if job.kind.startswith("cancel") or job.kind == "deadline":
        config = {**LONG_CONFIG, **{k: v for k, v in MODES[job.mode].items() if k != "k"}}
        if "k" not in MODE_SPECS[Mode(config["mode"])].applicable:  # a mode without blocks takes no k
            del config["k"]
        request = gateway_pb2.GenerateRequest(input_ids=LONG_IDS, config=overrides_to_wire(config))
    else:
        config = {**MODES[job.mode], "max_new_tokens": MAX_NEW}
        request = gateway_pb2.GenerateRequest(text=job.text, config=overrides_to_wire(config))
    start.wait(30)
    ids: list[int] = []
    try:
        if job.kind == "unary":
            return "OK", list(stub.Generate(request, timeout=60).output_ids)
        if job.kind == "stream":
            for message in stub.GenerateStream(request, timeout=60):
                ids += message.output_ids
            return "OK", ids
        if job.kind == "deadline":
            stub.Generate(request, timeout=CANCEL_AFTER_S)
            return "OK", []
        if job.kind == "cancel-unary":
            future = stub.Generate.future(request, timeout=60)
            time.sleep(CANCEL_AFTER_S)
            future.cancel()
            future.result()
            return "OK", []
        call = stub.GenerateStream(request, timeout=60)
        ids += next(call).output_ids  # decoding is under way (a first chunk arrived): cancel it mid-stream
        call.cancel()
        for message in call:
            ids += message.output_ids
        return "OK", ids
    except grpc.FutureCancelledError:
        return "CANCELLED", ids
    except grpc.RpcError as exc:
        return exc.code().name, ids




def _forwards_over_one_row(samples: dict[str, float]) -> float:
    return samples["specdec_verifier_batch_rows_count"] - samples['specdec_verifier_batch_rows_bucket{le="1.0"}']


def test_outputs_under_load_with_cancellations_equal_unbatched_in_process_decodes(served, expected):
    running = served.running
    before = scrape(running.verifier.host.metrics_port)
    jobs = _jobs()
    start = threading.Barrier(len(jobs))
    with grpc.insecure_channel(running.addresses["gateway"]) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: _run(stub, job, start), jobs))
    after = scrape(running.verifier.host.metrics_port)

    checked = 0
    for job, (code, ids) in zip(jobs, results, strict=True):
        if job.kind in ("unary", "stream"):
            assert code == "OK", (job, code)
            want = expected[("beam" if job.mode == "beam" else "greedy", job.text)]
            assert ids == want, (job, ids, want)
            checked += 1
        else:
            # Cancelled while decoding (255 new tokens of a 200-token source take far longer than the cancel).
            assert code == ("DEADLINE_EXCEEDED" if job.kind == "deadline" else "CANCELLED"), (job, code)
    assert checked == len(MODES) * len(TEXTS)

    # Batched for real: forwards of more than one row during the burst.
    assert _forwards_over_one_row(after) - _forwards_over_one_row(before) > 0
    # Every session, the cancelled requests' included, is freed.
    assert wait_until(lambda: running.verifier.active_sessions == 0 and running.drafter.active_sessions == 0, 10.0)
    gateway_port = running.gateway.host.metrics_port
    assert wait_until(lambda: scrape(gateway_port)["specdec_gateway_active_requests"] == 0, 10.0)
    verifier_now = scrape(running.verifier.host.metrics_port)
    drafter_now = scrape(running.drafter.host.metrics_port)
    assert verifier_now["specdec_verifier_active_sessions"] == 0
    assert drafter_now["specdec_drafter_active_sessions"] == 0
