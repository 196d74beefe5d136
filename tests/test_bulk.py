"""Bulk decoding (`specdec.bulk`, `LocalEngine.bulk`, `specdec decode --batch-size`): many inputs in
shared forwards give exactly what one at a time gives, in input order, with bad inputs reported in
place, progress on stderr and Ctrl-C writing what finished."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec
from core.errors import SpecdecError
from seq2seq_models.bundle import make_tiny_bundle
from specdec.bulk import BulkRun, Pending

REPO = Path(__file__).resolve().parent.parent
# Every mode, with settings that make its drafts matter on the tiny models.
MODES = {
    "ar": {}, "iad": {"k": 6}, "gad": {"k": 4}, "gad_adaptive": {"mode": "gad", "k": 6, "adaptive": True},
    "gad++": {"k": 4, "beta": 3, "tau": 2.0}, "beam": {"num_beams": 3}, "mjsd": {"gamma": 3, "num_beams": 2},
    "spec": {"gamma": 3, "temperature": 1.0, "seed": 5},
}
LOSSLESS = ("ar", "iad", "gad", "gad_adaptive")


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("bulk-bundle"), seed=3)


@pytest.fixture(scope="module")
def engine64(bundle_dir):
    """float64 torch models: a batched forward and a lone row's agree exactly."""
    with specdec.Engine.load(bundle_dir, backend="torch", dtype="float64") as engine:
        yield engine


def _inputs(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(5, 150) for _ in range(rng.randrange(2, 24))] for _ in range(n)]


def _params(name: str) -> dict:
    params = dict(MODES[name])
    params.setdefault("mode", name)
    return {**params, "max_new_tokens": 24}


@pytest.mark.parametrize("name", list(MODES))
def test_a_batched_run_equals_one_at_a_time(engine64, name):
    requests = [engine64.request(ids, "", _params(name)) for ids in _inputs(14)]
    alone = [o.output_ids for _, o in engine64.generate_each(requests, batch_size=1)]
    batched = [o.output_ids for _, o in engine64.generate_each(requests, batch_size=5)]
    assert batched == alone


def test_the_lossless_modes_equal_greedy_in_a_batch(engine64):
    inputs = _inputs(12, seed=1)
    greedy = [o.output_ids for o in engine64.generate(inputs, mode="ar", max_new_tokens=24)]
    for name in LOSSLESS[1:]:
        params = _params(name)
        assert [o.output_ids for o in engine64.generate(inputs, **params)] == greedy, name


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), batch=st.integers(2, 9), workers=st.integers(1, 2))
def test_any_batch_and_workers_give_greedy(engine64, seed, batch, workers):
    inputs = _inputs(7, seed)
    greedy = [o.output_ids for _, o in engine64.generate_each(
        [engine64.request(i, "", {"mode": "ar", "max_new_tokens": 16}) for i in inputs], batch_size=1)]
    for params in ({"mode": "iad", "k": 5}, {"mode": "gad", "k": 3}):
        requests = [engine64.request(i, "", {**params, "max_new_tokens": 16}) for i in inputs]
        outs = [o.output_ids for _, o in engine64.generate_each(requests, batch_size=batch, workers=workers)]
        assert outs == greedy, params


def test_the_default_backend_batches_identically(bundle_dir):
    """ONNX Runtime float32: batch invariance of the batched graph against the one-row graph."""
    with specdec.Engine.load(bundle_dir) as engine:
        inputs = _inputs(10, seed=2)
        for name in ("ar", "iad", "gad"):
            requests = [engine.request(i, "", _params(name)) for i in inputs]
            alone = [o.output_ids for _, o in engine.generate_each(requests, batch_size=1)]
            assert [o.output_ids for _, o in engine.generate_each(requests, batch_size=4)] == alone, name


def test_outcomes_come_in_input_order_or_as_they_finish(engine64):
    inputs = _inputs(12, seed=3)
    requests = [engine64.request(i, "", {"mode": "ar", "max_new_tokens": 20}) for i in inputs]
    requests[4] = engine64.request([], "", {"mode": "ar"})  # empty: refused in its place
    ordered = list(engine64.generate_each(requests, batch_size=4))
    assert [i for i, _ in ordered] == list(range(12))
    assert isinstance(ordered[4][1], SpecdecError) and "empty" in ordered[4][1].message
    unordered = list(engine64.generate_each(requests, ordered=False, batch_size=4))
    assert sorted(i for i, _ in unordered) == list(range(12))
    by_index = dict(unordered)
    for index, outcome in ordered:
        if index != 4:
            assert by_index[index].output_ids == outcome.output_ids


def test_many_inputs_through_the_api_are_checked_first(engine64):
    with pytest.raises(SpecdecError, match="input 1: input is empty"):
        engine64.generate([[5, 6, 7], [], [8, 9]], mode="ar")


def test_an_unknown_parameter_is_refused_by_name(engine64):
    with pytest.raises(SpecdecError, match="unknown decoding parameter batch_size") as caught:
        engine64.generate([[5, 6, 7], [8, 9]], mode="ar", batch_size=4)
    assert "max_new_tokens" in caught.value.message  # the parameters there are, named


def test_the_pools_hold_no_rows_once_a_run_is_done(bundle_dir):
    """Every row's slots go back to its model's pool as its session closes, whichever lane ran it and
    however rows were admitted, and a lane's twin shares its model's graphs, not its pool."""
    with specdec.Engine.load(bundle_dir) as engine:
        inputs = _inputs(13, seed=4)
        for workers in (1, 2):
            for name in ("ar", "gad", "iad"):
                requests = [engine.request(i, "", _params(name)) for i in inputs]
                cohorts = [o.output_ids for _, o in engine.bulk(requests, 4, workers=workers)]
                continuous = [o.output_ids for _, o in engine.bulk(requests, 4, workers=workers, cohorts=False)]
                assert continuous == cohorts, (name, workers)
        models = [(engine.verifier, engine.drafter), *(m for ms in engine._lane_models.values() for m in ms)]
        assert len(models) == 3
        for verifier, drafter in models:
            assert verifier.pool.used == [] and drafter.nar.pool.used == []
            assert verifier.pool.row_capacity > 0
        (first, _), (second, _) = models[1:]
        assert first.engine is second.engine and first.pool is not second.pool


def test_an_engine_loaded_for_two_workers_runs_them_on_its_own_models(bundle_dir):
    """`Engine.load(workers=2)` opens the models with each worker's share of the CPUs, and a bulk run
    of two workers runs twins of them (rows of their own, the same graphs): no second copy of the
    models is opened, and the outputs are those of one row at a time."""
    from core.threads import AUTO, worker_threads

    with specdec.Engine.load(bundle_dir, workers=2) as engine:
        assert engine.model_threads == worker_threads(AUTO, 2)
        requests = [engine.request(i, "", _params("iad")) for i in _inputs(9, seed=5)]
        together = [o.output_ids for _, o in engine.bulk(requests, 4, workers=2)]
        (lanes,) = engine._lane_models.values()
        assert len(lanes) == 2
        for verifier, _ in lanes:
            assert verifier.engine is engine.verifier.engine and verifier.pool is not engine.verifier.pool
        assert together == [o.output_ids for _, o in engine.bulk(requests, 1)]
    with specdec.Engine.load(bundle_dir) as engine:  # opened for one worker: two workers get a copy of their own
        list(engine.bulk(requests, 4, workers=2))
        (lanes,) = engine._lane_models.values()
        assert all(verifier.engine is not engine.verifier.engine for verifier, _ in lanes)


def test_cohorts_take_rows_only_once_their_lane_is_empty():
    """With cohorts a lane's next rows start together after its last row is done; continuously, a
    finished row's place is taken while the others run."""
    for cohorts in (True, False):
        events: list[tuple[str, int, int]] = []
        items = [Pending(i, i, 10) for i in range(12)]
        outcomes = list(BulkRun(items, _logged(events), batch_size=4, lanes=2, cohorts=cohorts))
        assert [o for _, o in outcomes] == list(range(12))
        refilled = False  # a row started beside one that began before another row ended
        running: dict[int, dict[int, bool]] = {0: {}, 1: {}}  # lane -> row -> has a row ended since it began
        for kind, lane, item in events:
            if kind == "start":
                refilled |= any(running[lane].values())
                running[lane][item] = False
            else:
                del running[lane][item]
                running[lane] = dict.fromkeys(running[lane], True)
        assert refilled != cohorts, events


def _logged(events: list[tuple[str, int, int]]):
    """A decode that takes 20-80 ms and logs its start and end."""
    lock = threading.Lock()

    def decode(item, stop, lane):
        with lock:
            events.append(("start", lane, item))
        time.sleep(0.02 + 0.03 * (item % 3))
        with lock:
            events.append(("end", lane, item))
        return item

    return decode


def test_runs_over_an_owners_pool_reuse_its_threads_and_leave_it_usable(bundle_dir):
    """A pool kept from run to run (the engine's): the second run decodes on the threads the first
    started, and an interrupted run leaves the pool to the next. The engine keeps one pool for every
    batch it has room for and a larger one past that, and lets it go when closed."""
    from concurrent.futures import ThreadPoolExecutor

    seen: list[set[int]] = []

    def decode(item, stop, lane):
        seen[-1].add(threading.get_ident())
        time.sleep(0.01)
        return item * 2

    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(2):
            seen.append(set())
            outcomes = list(BulkRun([Pending(i, i, 3) for i in range(10)], decode, batch_size=4, threads=pool))
            assert [o for _, o in outcomes] == [2 * i for i in range(10)]
        assert seen[1] <= seen[0]  # no new threads for the second run
        run = iter(BulkRun([Pending(i, i, 3) for i in range(10)], decode, batch_size=4, threads=pool))
        next(run)
        run.close()  # as Ctrl-C does: the run ends with rows in flight
        assert list(BulkRun([Pending(i, i, 3) for i in range(5)], decode, 4, threads=pool)) == [
            (i, 2 * i) for i in range(5)]
    with specdec.Engine.load(bundle_dir) as engine:
        threads = engine._decode_threads(8)
        assert engine._decode_threads(3) is threads and engine._decode_threads(9) is not threads
        larger = engine._decode_threads(9)
    with pytest.raises(RuntimeError):  # closed with the engine
        larger.submit(int)


def test_rows_are_admitted_longest_first_within_a_window():
    started: list[int] = []
    lock = threading.Lock()

    def decode(item, stop, lane):
        with lock:
            started.append(item)
        return item

    items = [Pending(i, length, length) for i, length in enumerate([5, 3, 9, 1, 7, 2])]
    outcomes = list(BulkRun(items, decode, batch_size=1, window=3))
    assert [o for _, o in outcomes] == [5, 3, 9, 1, 7, 2]  # given out in input order
    assert started == [9, 5, 3, 7, 2, 1]  # each window of 3 admitted longest first


# ---- the command ---------------------------------------------------------------------------------


def _decode_cmd(bundle_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "specdec", "decode", "--bundle", str(bundle_dir), "--backend", "torch",
            "--dtype", "float64", *args]


def _env() -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore"}


LINES = ["перше речення", "друге", "", "третє речення тут", "і ще одне", "п'яте речення", "шосте", "сьоме речення"]


def test_decode_batches_files_in_order_and_reports_bad_lines(bundle_dir, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    out1, out4, out_u = tmp_path / "one.jsonl", tmp_path / "four.jsonl", tmp_path / "unordered.jsonl"
    flags = ["--mode", "gad", "--k", "4", "--max-new-tokens", "16", "--input", str(source), "--progress"]
    one = subprocess.run(_decode_cmd(bundle_dir, *flags, "--batch-size", "1", "--output", str(out1)),
                         capture_output=True, text=True, env=_env(), timeout=300, cwd=REPO)
    four = subprocess.run(_decode_cmd(bundle_dir, *flags, "--batch-size", "4", "--output", str(out4)),
                          capture_output=True, text=True, env=_env(), timeout=300, cwd=REPO)
    unordered = subprocess.run(_decode_cmd(bundle_dir, *flags, "--batch-size", "4", "--unordered", "--output",
                                           str(out_u)), capture_output=True, text=True, env=_env(), timeout=300,
                               cwd=REPO)
    for proc in (one, four, unordered):
        assert proc.returncode == 2, proc.stderr  # the empty line failed, the others went on
        assert "Traceback" not in proc.stderr
        assert "INVALID_ARGUMENT: line 3: input is empty" in proc.stderr
    records_one = [json.loads(x) for x in out1.read_text().splitlines()]
    records_four = [json.loads(x) for x in out4.read_text().splitlines()]
    assert len(records_one) == len(LINES) and records_one[2] == records_four[2] == {
        "line": 3, "error": "input is empty", "code": "INVALID_ARGUMENT"}
    assert [r.get("output_ids") for r in records_four] == [r.get("output_ids") for r in records_one]
    records_u = [json.loads(x) for x in out_u.read_text().splitlines()]
    assert sorted(r["line"] for r in records_u) == list(range(1, len(LINES) + 1))
    by_line = {r["line"]: r.get("output_ids") for r in records_u}
    assert [by_line[n] for n in range(1, len(LINES) + 1)] == [r.get("output_ids") for r in records_one]
    # Not a terminal: the progress is plain lines, the last one a summary (no carriage returns).
    assert f"{len(LINES)}/{len(LINES)} lines" in four.stderr and "\r" not in four.stderr


def test_decode_draws_a_progress_bar_on_a_terminal(bundle_dir, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(x for x in LINES if x) + "\n", encoding="utf-8")
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        _decode_cmd(bundle_dir, "--mode", "ar", "--max-new-tokens", "8", "--input", str(source), "--output",
                    str(tmp_path / "out.jsonl")),
        stdout=subprocess.DEVNULL, stderr=follower, env=_env(), cwd=REPO,
    )
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(60) == 0
    os.close(leader)
    text = seen.decode("utf-8", "replace")
    assert "\r" in text and "100%" in text, text  # tqdm redraws its bar in place and ends full
    assert "Traceback" not in text


def test_ctrl_c_writes_what_finished_and_exits_non_zero(bundle_dir, tmp_path):
    lines = 3000
    source = tmp_path / "many.txt"
    source.write_text("\n".join(f"речення номер {i} тут" for i in range(lines)) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        _decode_cmd(bundle_dir, "--mode", "ar", "--max-new-tokens", "48", "--batch-size", "4", "--input",
                    str(source), "--output", str(out), "--progress", "--unordered"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO,
        # A test worker may ignore SIGINT, and an ignored signal is inherited: give the child Ctrl-C back.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not out.exists() or out.stat().st_size == 0):
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert 0 < len(records) < lines
    assert all(r.get("output_ids") for r in records)
    assert len({r["line"] for r in records}) == len(records)


def test_decode_workers_auto_takes_a_worker_per_cpu_with_onnx_runtime_on_a_cpu():
    """`specdec decode --workers auto` (the default): one model worker per usable CPU (per --threads
    CPUs) with ONNX Runtime on a CPU, each with at least ROWS_PER_WORKER of the batch's lines; one for
    a batch of 1 or another backend. A value neither auto nor a whole number is refused saying so."""
    import argparse

    from core.threads import usable_cpus
    from specdec.commands.decode import ROWS_PER_WORKER, _workers, auto_workers

    def args(**changed) -> argparse.Namespace:
        return argparse.Namespace(**{"batch_size": 32, "backend": None, "device": "cpu", "threads": None, **changed})

    cpus = usable_cpus()
    assert auto_workers(args()) == max(1, min(cpus, 32 // ROWS_PER_WORKER))
    assert auto_workers(args(batch_size=10_000)) == cpus
    assert auto_workers(args(batch_size=ROWS_PER_WORKER)) == 1
    assert auto_workers(args(batch_size=1)) == 1
    assert auto_workers(args(backend="torch")) == 1
    assert auto_workers(args(batch_size=10_000, threads=cpus)) == 1
    assert _workers("auto") == "auto" and _workers("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match=r"got 'two' \(or auto\)"):
        _workers("two")
