"""The gateway's load metrics through a real `specdec serve all`, scraped over HTTP as Prometheus would:
histogram counts equal the requests made, and the spec_decode counters equal the sums of the stats
the responses carried, exactly."""

from __future__ import annotations

import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from seq2seq_models.bundle import TOKENIZER_FILE, load_bundle, save_bundle
from tests.faults.servers import LOOP, serve_all

TEXTS = ["We have been living in this city.", "Я хочу подякувати вам за вашу допомогу."]
MODES = {
    "gad": {"k": 4},
    "spec": {"gamma": 3, "temperature": 0.9, "top_k": 20, "top_p": 0.95},
    "mjsd": {"gamma": 3, "num_beams": 2, "threshold": 0.2},
    "ar": {},
}
RPCS = ("Generate", "GenerateStream")


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://{LOOP}:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _call(address: str, mode: str, rpc: str, text: str) -> tuple[list[int], gateway_pb2.DecodingStats]:
    overrides = {"mode": mode, **MODES[mode], "max_new_tokens": 24, "seed": 5}
    request = gateway_pb2.GenerateRequest(text=text, config=overrides_to_wire(overrides))
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        if rpc == "Generate":
            response = stub.Generate(request, timeout=120)
            return list(response.output_ids), response.stats
        ids: list[int] = []
        for message in stub.GenerateStream(request, timeout=120):
            ids.extend(message.output_ids)
            if message.final:
                return ids, message.stats
    raise AssertionError("the stream ended without a final message")


@pytest.fixture(scope="module")
def self_drafting_bundle(bundle_dir, tmp_path_factory) -> Path:
    """The tiny random bundle with its verifier as AR drafter too, so that drafts are accepted (a
    random drafter's never are) and the per-position counters have something to count."""
    tiny = load_bundle(bundle_dir)
    models = {"verifier": tiny.verifier, "nar_drafter": tiny.nar_drafter, "ar_drafter": tiny.verifier}
    out = tmp_path_factory.mktemp("self-drafting-bundle")
    return save_bundle(out, (bundle_dir / TOKENIZER_FILE).read_bytes(), models, name="tiny-self-drafting")


@pytest.fixture(scope="module")
def served(self_drafting_bundle, tmp_path_factory):
    # One decode worker: concurrent requests queue in admission, so the queue-wait histogram sees waits.
    s = serve_all(self_drafting_bundle, tmp_path_factory.mktemp("metrics-load"), gateway={"workers": 1})
    try:
        yield s
    finally:
        s.kill()


def test_load_metrics_match_the_requests_and_their_stats(served):
    calls = [(mode, rpc, text) for mode in MODES for rpc in RPCS for text in TEXTS]
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda c: _call(served.address, *c), calls))
    m = _scrape(served.metrics_ports["gateway"])

    made = Counter((mode, rpc) for mode, rpc, _ in calls)
    for (mode, rpc), n in made.items():
        labels = (("mode", mode), ("rpc", rpc))
        assert m[("specdec_gateway_request_seconds_count", labels)] == n
        assert m[("specdec_gateway_request_seconds_bucket", (("le", "+Inf"), *labels))] == n
        # The histogram's sum is the requests' own total time, as their stats report it (ms).
        total_ms = sum(
            s.drafter_time_ms + s.verifier_time_ms + s.gateway_time_ms
            for (md, r, _), (_, s) in zip(calls, results, strict=True) if (md, r) == (mode, rpc)
        )
        assert m[("specdec_gateway_request_seconds_sum", labels)] == pytest.approx(total_ms / 1e3, rel=1e-6)
        buckets = [v for (name, ls), v in m.items() if name == "specdec_gateway_request_seconds_bucket"
                   and dict(ls)["mode"] == mode and dict(ls)["rpc"] == rpc]
        assert len(buckets) == 17  # 16 bounds from 1 ms to 60 s, and +Inf

    # Time to first token: one observation per stream (every stream here produced tokens).
    streams = Counter(mode for mode, rpc, _ in calls if rpc == "GenerateStream")
    assert all(ids for ids, _ in results)
    for mode, n in streams.items():
        assert m[("specdec_gateway_time_to_first_token_seconds_count", (("mode", mode),))] == n
        # The first token comes before the whole stream is done (a few ms apart in where each is timed).
        whole = m[("specdec_gateway_request_seconds_sum", (("mode", mode), ("rpc", "GenerateStream")))]
        assert m[("specdec_gateway_time_to_first_token_seconds_sum", (("mode", mode),))] <= whole + 0.01 * n

    # Admission: every request was admitted once; with one worker, some of them waited.
    assert m[("specdec_gateway_queue_wait_seconds_count", ())] == len(calls)
    assert m[("specdec_gateway_queue_wait_seconds_sum", ())] > 0
    assert m[("specdec_gateway_queue_wait_seconds_bucket", (("le", "0.001"),))] >= 1  # the first went straight in

    # spec_decode counters and output tokens: exactly the sums of what the responses said.
    draft, accepted, emitted, draft_steps = Counter(), Counter(), Counter(), Counter()
    per_pos: dict[tuple[str, int], int] = defaultdict(int)
    for (mode, _, _), (ids, stats) in zip(calls, results, strict=True):
        assert not stats.degraded
        draft[mode] += stats.drafted_tokens
        draft_steps[mode] += sum(stats.steps_per_draft_length[1:])
        accepted[mode] += stats.accepted_tokens
        emitted[mode] += len(ids)
        for position, count in enumerate(stats.accepted_per_position):
            per_pos[mode, position] += count
    # Not vacuous: drafts were made and (by the self-drafting AR drafter) accepted at several positions.
    assert draft["gad"] > 0 and accepted["spec"] > 0 and accepted["mjsd"] > 0 and draft["ar"] == 0
    assert {pos for _, pos in per_pos} >= {0, 1, 2}
    for mode in MODES:
        labels = (("mode", mode),)
        assert m[("specdec_spec_decode_num_draft_tokens_total", labels)] == draft[mode]
        # Steps that drafted, not every step of a request that drafted once.
        assert m[("specdec_gateway_drafts_total", labels)] == draft_steps[mode]
        assert m[("specdec_spec_decode_num_accepted_tokens_total", labels)] == accepted[mode]
        assert m[("specdec_spec_decode_num_emitted_tokens_total", labels)] == emitted[mode]
        assert m[("specdec_gateway_tokens_out_total", labels)] == emitted[mode]
        assert m[("specdec_gateway_requests_total", labels)] == len(RPCS) * len(TEXTS)
    exported_pos = {
        (dict(ls)["mode"], int(dict(ls)["position"])): v
        for (name, ls), v in m.items() if name == "specdec_spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert exported_pos == per_pos and per_pos


def test_serve_all_exports_each_service_on_its_own_port(served):
    # Three services in one process: each endpoint has its own registry and only its own metrics.
    prefixes = {"gateway": "specdec_gateway_", "verifier": "specdec_verifier_", "drafter": "specdec_drafter_"}
    for role, port in served.metrics_ports.items():
        names = {name for name, _ in _scrape(port)}
        assert any(n.startswith(prefixes[role]) for n in names), role
        for other, prefix in prefixes.items():
            if other != role:
                assert not any(n.startswith(prefix) for n in names), (role, other)
        assert any(n.startswith("specdec_spec_decode_") for n in names) == (role == "gateway")
