"""`specdec loadtest` against a real `serve all` (tiny bundle, loopback): closed, open and wave loops,
unary and streaming, `--json` counts checked exactly against one-by-one `Generate` calls, a refused
setting reported by its status code, `--sweep`; and the loops' scheduling itself."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from evaluation import loadtest
from serving.metrics import MetricsServer, Registry
from specdec.cli import main as cli_main
from specdec.client import generate
from specdec.serve import ServiceStack
from tests.services.conftest import LOOPBACK

TEXTS = ["hello world", "another line of text", "шо там", "a b c d e f"]
FLAGS = ["--mode", "gad", "--k", "3", "--max-new-tokens", "12"]
OVERRIDES = {"mode": "gad", "k": 3, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from seq2seq_models.bundle import make_tiny_bundle

    bundle = make_tiny_bundle(tmp_path_factory.mktemp("loadtest-bundle"), seed=3)
    inputs = tmp_path_factory.mktemp("loadtest-inputs") / "inputs.txt"
    inputs.write_text("\n".join(TEXTS) + "\n\n")  # the blank line is skipped
    with ServiceStack("all", bundle, LOOPBACK) as stack:
        address = stack.running.addresses["gateway"]
        # What each input decodes to, one call at a time: the load test's token counts must match.
        tokens = [len(generate(address, text, OVERRIDES, timeout=60)["output_ids"]) for text in TEXTS]
        yield address, str(inputs), tokens


def run_json(capsys, *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = cli_main(["loadtest", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def expected_tokens(tokens: list[int], requests: int) -> int:
    return sum(tokens[i % len(tokens)] for i in range(requests))


def check_success(report: dict, requests: int, tokens: list[int]) -> None:
    assert report["requests"] == report["ok"] == requests
    assert report["errors"] == {}
    assert report["output_tokens"] == expected_tokens(tokens, requests)
    lat = report["latency_ms"]
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
    assert report["requests_per_s"] == pytest.approx(requests / report["wall_s"])
    assert report["output_tokens_per_s"] == pytest.approx(report["output_tokens"] / report["wall_s"])


def test_closed_loop_unary(served, capsys):
    address, inputs, tokens = served
    code, report = run_json(capsys, "--addr", address, "--inputs", inputs, "--concurrency", "3", "--requests", "7",
                            *FLAGS)
    assert code == 0
    check_success(report, 7, tokens)
    assert (report["loop"], report["rpc"], report["concurrency"], report["rate"]) == ("closed", "Generate", 3, None)
    assert report["config"] == OVERRIDES
    assert report["ttft_ms"] is None  # unary calls have no first token


def test_open_loop_stream(served, capsys):
    address, inputs, tokens = served
    code, report = run_json(capsys, "--addr", address, "--inputs", inputs, "--rate", "40", "--requests", "9",
                            "--stream", *FLAGS)
    assert code == 0
    check_success(report, 9, tokens)
    shape = (report["loop"], report["rpc"], report["concurrency"], report["rate"])
    assert shape == ("open", "GenerateStream", None, 40)
    assert report["wall_s"] >= 8 / 40  # the ninth request arrives 8/40 s after the first
    ttft, lat = report["ttft_ms"], report["latency_ms"]
    assert 0 < ttft["p50"] <= ttft["p95"] <= ttft["p99"]
    assert ttft["max"] <= lat["max"]


def test_waves_and_duration_bound(served, capsys):
    address, inputs, tokens = served
    code, report = run_json(capsys, "--addr", address, "--inputs", inputs, "--concurrency", "2", "--waves",
                            "--requests", "5", *FLAGS)
    assert code == 0
    check_success(report, 5, tokens)
    assert report["loop"] == "waves"
    # No --requests: --duration bounds the run; requests in flight at the bound still finish and count.
    code, report = run_json(capsys, "--addr", address, "--inputs", inputs, "--concurrency", "2", "--duration", "0.3",
                            *FLAGS)
    assert code == 0
    assert report["requests"] >= 2
    check_success(report, report["requests"], tokens)
    assert report["wall_s"] >= 0.3


def test_default_bound_is_one_pass_over_the_inputs(served, capsys):
    address, inputs, tokens = served
    code, report = run_json(capsys, "--addr", address, "--inputs", inputs, "--concurrency", "2", *FLAGS)
    assert code == 0
    check_success(report, len(TEXTS), tokens)


def test_a_refused_setting_is_counted_by_status_code(served, capsys):
    address, inputs, _ = served
    code, report = run_json(capsys, "--addr", address, "--inputs", inputs, "--concurrency", "2", "--requests", "4",
                            "--mode", "gad", "--k", "0")
    assert code == 1  # no request succeeded
    assert (report["requests"], report["ok"], report["errors"]) == (4, 0, {"INVALID_ARGUMENT": 4})
    assert report["output_tokens"] == 0 and report["latency_ms"] is None
    # The human-readable summary names the code too.
    capsys.readouterr()
    cli_main(["loadtest", "--addr", address, "--inputs", inputs, "--requests", "2", "--mode", "gad", "--k", "0"])
    assert "errors             INVALID_ARGUMENT 2" in capsys.readouterr().out


def test_sweep(served, capsys):
    address, inputs, tokens = served
    code, out = run_json(capsys, "--addr", address, "--inputs", inputs, "--sweep", "1,3", "--requests", "6", *FLAGS)
    assert code == 0
    assert [r["concurrency"] for r in out["sweep"]] == [1, 3]
    for report in out["sweep"]:
        check_success(report, 6, tokens)
    capsys.readouterr()
    assert cli_main(["loadtest", "--addr", address, "--inputs", inputs, "--sweep", "1,2", "--requests", "2",
                     "--stream", *FLAGS]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].startswith("| clients | requests | errors | requests/s | tokens/s | p50 ms")
    assert "TTFT p50 ms" in table[1]
    assert [row.split("|")[1].strip() for row in table[3:]] == ["1", "2"]


def test_bad_flags_are_one_line_errors(served, capsys):
    address, inputs, _ = served
    assert cli_main(["loadtest", "--addr", address, "--inputs", inputs, "--rate", "5", "--waves"]) == 2
    assert "--waves is a closed loop" in capsys.readouterr().err
    assert cli_main(["loadtest", "--addr", address, "--inputs", inputs, "--sweep", "1,x"]) == 2
    assert "--sweep expects" in capsys.readouterr().err


class _Recorder:
    """Stands in for the gRPC client to watch the loops' scheduling: how many requests are in flight
    when each starts, and when each wave starts."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.in_flight = 0
        self.seen: list[int] = []
        self.starts: list[float] = []
        self.ends: list[float] = []

    async def send(self, i: int, tally, client_key: str) -> None:
        self.in_flight += 1
        self.seen.append(self.in_flight)
        self.starts.append(time.perf_counter())
        await asyncio.sleep(self.seconds * (1 + i % 3))  # uneven: the waves wait for their slowest
        self.in_flight -= 1
        self.ends.append(time.perf_counter())
        tally.outcomes.append(loadtest.Outcome("OK", 0.0))


def test_closed_loop_keeps_n_in_flight_and_waves_wait_for_the_slowest():
    spec = loadtest.LoadSpec("unused", ["x"], concurrency=3, requests=9)
    view = loadtest.LoadSpecView(spec, requests=9)

    closed = _Recorder(0.01)
    asyncio.run(loadtest._closed_loop(closed, view, loadtest._Tally(), 3))
    assert max(closed.seen) == 3 and len(closed.seen) == 9
    # A closed loop refills a slot as soon as it frees: some request starts before the first three all ended.
    assert sorted(closed.starts)[3] < max(sorted(closed.ends)[:3])

    waves = _Recorder(0.01)
    asyncio.run(loadtest._waves(waves, view, loadtest._Tally(), 3))
    assert len(waves.seen) == 9 and max(waves.seen) == 3
    starts = sorted(waves.starts)
    ends = sorted(waves.ends)
    for w in (1, 2):  # every request of wave w starts after every request of wave w-1 ended
        assert starts[3 * w] >= ends[3 * w - 1]


def test_batch_rows_come_from_a_prometheus_histogram():
    registry = Registry()
    rows = registry.histogram("verifier_batch_rows", "rows per forward", (1, 2, 4, 8, 16, 32))
    rows.observe(30)  # before the run: not counted
    server = MetricsServer(registry, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        before = loadtest._scrape_all([url])
        for value in (2, 4, 9):
            rows.observe(value)
        after = loadtest._scrape_all([url])
    finally:
        server.stop()
    assert loadtest._batch_rows_delta(before, after) == {"specdec_verifier_batch_rows": pytest.approx(5.0)}
    assert loadtest._batch_rows_delta(after, after) == {}  # no forward during the run: nothing to report


def test_worker_busy_comes_from_the_forward_and_encode_seconds_histograms():
    registry = Registry()
    forward = registry.histogram("drafter_forward_seconds", "duration of a forward", (0.01, 0.1, 1))
    encode = registry.histogram("verifier_encode_seconds", "duration of an encoder run", (0.01, 0.1, 1))
    forward.observe(5.0)  # before the run: not counted
    server = MetricsServer(registry, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        before = loadtest._scrape_all([url])
        for value in (0.25, 0.75):
            forward.observe(value)
        encode.observe(0.5)
        after = loadtest._scrape_all([url])
    finally:
        server.stop()
    busy, mean_ms = loadtest._busy_delta(before, after, wall_s=4.0)
    # 1 s of forwards and 0.5 s of encoder runs in 4 s.
    assert busy == {"specdec_drafter_forward_seconds": pytest.approx(0.25),
                    "specdec_verifier_encode_seconds": pytest.approx(0.125)}
    assert mean_ms == {"specdec_drafter_forward_seconds": pytest.approx(500.0),
                       "specdec_verifier_encode_seconds": pytest.approx(500.0)}
    assert loadtest._batch_rows_delta(before, after) == {}  # not a rows histogram
    assert loadtest._busy_delta(after, after, 4.0) == ({}, {})


def test_ua_gec_inputs_are_the_benchmarks_sentences(served, capsys):
    from training.data import load_test_set

    texts = loadtest.ua_gec_texts(3)
    assert texts == [item.source for item in load_test_set()[:3]]
    address, _, _ = served
    code, report = run_json(capsys, "--addr", address, "--ua-gec", "3", "--concurrency", "3", *FLAGS)
    assert code == 0
    assert (report["requests"], report["ok"]) == (3, 3)
    assert report["output_tokens"] == sum(len(generate(address, t, OVERRIDES, timeout=60)["output_ids"]) for t in texts)


@pytest.mark.parametrize("stream", [False, True])
def test_record_keeps_each_requests_output_ids(served, stream):
    address, _, _ = served
    want = [generate(address, text, OVERRIDES, timeout=60)["output_ids"] for text in TEXTS]
    spec = loadtest.LoadSpec(address, TEXTS, OVERRIDES, stream=stream, concurrency=3, requests=6, record=True)
    report = loadtest.run_load(spec)
    assert report.outputs == {i: want[i % len(TEXTS)] for i in range(6)}
    assert json.loads(json.dumps(report.to_dict()))["outputs"]["5"] == want[1]
    # Without record nothing is kept, and the JSON has no "outputs".
    plain = loadtest.run_load(loadtest.LoadSpec(address, TEXTS, OVERRIDES, concurrency=2, requests=2))
    assert plain.outputs == {} and "outputs" not in plain.to_dict()
