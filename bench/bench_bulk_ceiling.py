"""Bulk decoding's ceilings: how fast specdec's bulk engine could go on this host if everything but its
model forwards cost nothing, against CTranslate2 on the same cores; and, through the services, what
share of the host's cores the verifier gets.

    python bench/bench_bulk_ceiling.py                      # print the tables
    python bench/bench_bulk_ceiling.py --services --write   # the "Bulk decoding: ceilings" section

In-process, on one core: each mode decodes the first `--sentences` UA-GEC test sentences with one model
worker of one intra-op thread at batch 32 (`Engine.bulk`), while every ONNX Runtime `run` is timed per
graph (the encoder, the one-token step decoder, the batched decoder, the one-row decoder, the
drafter's). One worker runs its forwards one after another, so their sum is the forwards' time; the
rest of the wall time is everything else (Python, copies into the K/V pool, scheduling). "Forwards
only" is the output tokens over the forwards' time: the rate with everything else free. For IAD the
batched decoder's positions are counted too (a block's real tokens, and its padded width times the
rows), and "one position a token" scales the decoder's time to one verified position per output
token (a drafter that is never wrong, with the same cost per position): IAD's forwards can go no
faster without cheaper forwards. CTranslate2 runs the same sentences with `translate_batch` at one
thread (1x1) and two (2x1; int8, max_batch_size 64 examples' worth of tokens, its best cell in "Bulk
decoding"), and specdec at two model workers of one thread at its best batch; besides, AR and IAD at
32 rows over two workers admitted as others finish (continuous admission: the rows the services hold
at 32 clients, coming as theirs do). Every row is interleaved with the others in `--rounds` rounds;
medians.

With `--services`: `specdec serve all --processes` (two verifier model workers of one thread) at 32
closed-loop clients of `evaluation.loadtest` in this process, AR and IAD k=32: the CPU seconds of each
process over the measured run (/proc: the load generator, the gateway, the verifier, the drafter),
and "all CPU to the verifier": the rate times the host's CPU seconds over the verifier's, the most the
stack reaches if the load generator and the gateway cost nothing, against the in-process rate of
two workers at their best batch and at the services' shape.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import bench_parser, machine_stamp, publish

REPO = Path(__file__).resolve().parents[1]
HEADING = "## Bulk decoding: ceilings"
MAX_NEW_TOKENS = 200
CLIENTS = 32
MODES: list[tuple[str, dict[str, Any]]] = [
    ("AR greedy", {"mode": "ar"}),
    ("IAD k=32", {"mode": "iad", "k": 32}),
    ("GAD k=10", {"mode": "gad", "k": 10}),
]
# Each mode's best cell at two model workers in "Bulk decoding".
TWO_WORKER_BATCH = {"AR greedy": 64, "IAD k=32": 32, "GAD k=10": 32}
# Graph files by what they are (ONNX Runtime sessions' model paths end so).
GRAPHS = {"encoder.onnx": "encoder", "decoder_step.onnx": "step decoder", "decoder_batch.onnx": "batched decoder",
          "decoder.onnx": "one-row decoder"}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, REPO)
    p.add_argument("--sentences", type=int, default=200, help="UA-GEC test sentences (default: 200)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    p.add_argument("--services", action="store_true", help="also serve all --processes at 32 clients")
    args = p.parse_args(argv)
    from evaluation.loadtest import ua_gec_texts

    texts = ua_gec_texts(args.sentences, args.data_dir)
    rows, two = in_process(args, texts)
    lines = [*core_table(rows), "", *two_core_table(two)]
    if args.services:
        lines += ["", *services_table(args, texts, two)]
    intro = (f"UA-GEC test split, first {len(texts)} sentences, int8, max_new_tokens {MAX_NEW_TOKENS}; "
             f"medians of {args.rounds} interleaved rounds (module docstring of `bench/bench_bulk_ceiling.py`). "
             "One core: specdec at batch 32 with one model worker of one intra-op thread, its ONNX Runtime "
             "forwards timed; CTranslate2 at 1x1 threads.")
    return publish(args, HEADING, machine_stamp("int8 (specdec: ONNX Runtime)"), intro, lines)


# ---- in-process ---------------------------------------------------------------------------------------


@dataclass
class Forwards:
    """ONNX Runtime's time per graph over one run, and the batched decoder's positions."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    real_positions: int = 0  # the batched decoder's blocks' tokens
    padded_positions: int = 0  # its rows times its block width

    def total(self) -> float:
        return sum(self.seconds.values())


@dataclass
class Row:
    label: str
    setting: str = ""
    services_shape: bool = False  # 32 rows over two workers, admitted as they come: the services' own
    rates: list[float] = field(default_factory=list)  # output tokens/s, one per round
    forwards: list[tuple[int, Forwards]] = field(default_factory=list)  # (output tokens, forwards) per round

    def rate(self) -> float:
        return statistics.median(self.rates)


@dataclass
class Cell:
    """A row and its run (-> output tokens, seconds); `timed`: its forwards are timed."""

    row: Row
    run: Callable[[], tuple[int, float]]
    timed: bool = False


class ForwardClock:
    """Times every ONNX Runtime `InferenceSession.run` while `recording` (the class's method wrapped
    once): per graph, keyed by its file name and whether it is the drafter's."""

    def __init__(self) -> None:
        import onnxruntime as ort

        self.record: Forwards | None = None
        self._lock = threading.Lock()
        original = ort.InferenceSession.run
        clock = self

        def run(session: Any, output_names: Any, feeds: Any, *a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            out = original(session, output_names, feeds, *a, **k)
            took = time.perf_counter() - started
            if clock.record is not None:
                clock._add(str(getattr(session, "_model_path", "")), feeds, took)
            return out

        ort.InferenceSession.run = run

    def _add(self, path: str, feeds: Any, took: float) -> None:
        name = GRAPHS.get(Path(path).name, Path(path).name)
        if "drafter" in Path(path).parent.name:
            name = "drafter"
        with self._lock:
            rec = self.record
            assert rec is not None
            rec.seconds[name] = rec.seconds.get(name, 0.0) + took
            rec.calls[name] = rec.calls.get(name, 0) + 1
            if name == "batched decoder" and isinstance(feeds, dict) and "tokens" in feeds:
                rows, width = feeds["tokens"].shape
                rec.padded_positions += rows * width
                rec.real_positions += int(feeds["block_lens"].sum())


def in_process(args: Any, texts: list[str]) -> tuple[list[Row], list[Row]]:
    """One core (specdec's rows with their forwards timed; CTranslate2 1x1), and two (specdec's two
    model workers; CTranslate2 2x1), in interleaved rounds."""
    import specdec
    from bench.bench_bulk import CT2_TOKENS_PER_EXAMPLE, ct2_inputs
    from seq2seq_models.bundle import load_bundle

    clock = ForwardClock()
    ct2_dir, _vocab, ct2_tokens = ct2_inputs(load_bundle(args.bundle), texts)
    engine = specdec.Engine.load(args.bundle, precision="int8")
    requests = {label: [engine.request(x, "", {**params, "max_new_tokens": MAX_NEW_TOKENS}) for x in texts]
                for label, params in MODES}

    def specdec_run(label: str, batch: int, workers: int, threads: int | None,
                    cohorts: bool = True) -> Callable[[], tuple[int, float]]:
        def run() -> tuple[int, float]:
            started = time.perf_counter()
            outputs = engine.bulk(requests[label], batch, workers=workers, threads=threads, cohorts=cohorts)
            tokens = sum(len(o.output_ids) for _, o in outputs)
            return tokens, time.perf_counter() - started
        return run

    def ct2_run(inter: int) -> Callable[[], tuple[int, float]]:
        from bench.bench_bulk import _translator

        translator = _translator(ct2_dir, "int8", inter, 1)

        def run() -> tuple[int, float]:
            started = time.perf_counter()
            results = translator.translate_batch(
                ct2_tokens, max_batch_size=64 * CT2_TOKENS_PER_EXAMPLE, batch_type="tokens", beam_size=1,
                max_decoding_length=MAX_NEW_TOKENS, return_end_token=False)
            return sum(len(r.hypotheses[0]) for r in results), time.perf_counter() - started
        return run

    one = [Cell(Row("CTranslate2, 1x1 threads"), ct2_run(1))]
    one += [Cell(Row(label), specdec_run(label, 32, 1, 1), timed=True) for label, _ in MODES]
    two = [Cell(Row("CTranslate2, 2x1 threads"), ct2_run(2))]
    two += [Cell(Row(label, f"batch {TWO_WORKER_BATCH[label]}, 2 model workers"),
                 specdec_run(label, TWO_WORKER_BATCH[label], 2, 1)) for label, _ in MODES]
    two += [Cell(Row(label, f"batch {CLIENTS}, 2 model workers, rows admitted as others finish", True),
                 specdec_run(label, CLIENTS, 2, 1, cohorts=False)) for label, _ in MODES[:2]]
    for cell in one + two:  # warm: models opened, pools grown, first calls made
        cell.run()
    for r in range(args.rounds):
        for cell in one + two:
            clock.record = Forwards() if cell.timed else None
            tokens, seconds = cell.run()
            if clock.record is not None:
                cell.row.forwards.append((tokens, clock.record))
            clock.record = None
            cell.row.rates.append(tokens / seconds)
            print(f"round {r + 1}/{args.rounds} {cell.row.label}: {tokens / seconds:.0f} tok/s", file=sys.stderr)
    return [cell.row for cell in one], [cell.row for cell in two]


def core_table(rows: list[Row]) -> list[str]:
    ct2 = rows[0].rate()
    lines = [
        "| one core | output tokens/s | vs CTranslate2 1x1 | forwards' share of the wall time | forwards only, "
        "tokens/s | vs CTranslate2 1x1 | encoder / decoder / drafter share of the forwards |",
        "|---|---:|---:|---:|---:|---:|---|",
        f"| {rows[0].label} | {ct2:.0f} | 1.00x | | | | |",
    ]
    notes = []
    for row in rows[1:]:
        rate = row.rate()
        per_round = [(tokens, fw) for tokens, fw in row.forwards]
        only = statistics.median(tokens / fw.total() for tokens, fw in per_round)
        share = statistics.median(fw.total() * r / tokens for (tokens, fw), r in zip(per_round, row.rates,
                                                                                      strict=True))
        fw = Forwards()
        for _, f in per_round:
            for name, s in f.seconds.items():
                fw.seconds[name] = fw.seconds.get(name, 0.0) + s
            fw.real_positions += f.real_positions
            fw.padded_positions += f.padded_positions
        total = fw.total()
        enc = fw.seconds.get("encoder", 0.0) / total
        draft = fw.seconds.get("drafter", 0.0) / total
        lines.append(f"| specdec {row.label} | {rate:.0f} | {rate / ct2:.2f}x | {share:.0%} | {only:.0f} | "
                     f"{only / ct2:.2f}x | {enc:.0%} / {1 - enc - draft:.0%} / {draft:.0%} |")
        if fw.real_positions:
            tokens = sum(t for t, _ in per_round)
            decoder = fw.seconds.get("batched decoder", 0.0)
            oracle = tokens / (total - decoder * (1 - tokens / fw.real_positions))
            notes.append(
                f"- {row.label}: the batched decoder verified {fw.real_positions / tokens:.2f} positions an output "
                f"token ({fw.padded_positions / tokens:.2f} with the blocks' padding); at one position a token, "
                f"its forwards alone would give {oracle:.0f} tokens/s, {oracle / ct2:.2f}x CTranslate2 1x1.")
    return [*lines, "", *notes]


def two_core_table(rows: list[Row]) -> list[str]:
    ct2 = rows[0].rate()
    lines = ["| two cores | setting | output tokens/s | vs CTranslate2 2x1 |", "|---|---|---:|---:|",
             f"| {rows[0].label} | int8, max_batch_size 64 examples' tokens | {ct2:.0f} | 1.00x |"]
    for row in rows[1:]:
        lines.append(f"| specdec {row.label} | {row.setting} | "
                     f"{row.rate():.0f} | {row.rate() / ct2:.2f}x |")
    return lines


# ---- services -----------------------------------------------------------------------------------------


def services_table(args: Any, texts: list[str], two: list[Row]) -> list[str]:
    """Each mode through `serve all --processes` at CLIENTS clients: its rate, each process's share of
    the CPU seconds spent during the run, and the rate if the verifier had all of them."""
    from bench.bench_bulk import _services_toml
    from evaluation.bench_report import start_services
    from evaluation.loadtest import LoadSpec, run_load

    config = Path(tempfile.mkdtemp()) / "bulk.toml"
    config.write_text(_services_toml("int8"))
    proc, address = start_services(Path(args.bundle), "onnxruntime", extra_args=(
        "--config", str(config), "--processes", "--verifier-model-workers", "2"))
    lines = ["| services, 32 clients | output tokens/s | vs in-process best | vs in-process at the services' shape | "
             "load generator | gateway | verifier | drafter | all CPU to the verifier, tokens/s | vs in-process best |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    try:
        processes = _service_processes(proc.pid)
        for label, params in MODES[:2]:
            in_process = next(row for row in two if row.label == label and not row.services_shape).rate()
            same_shape = next(row for row in two if row.label == label and row.services_shape).rate()
            spec = LoadSpec(address=address, inputs=texts, overrides={**params, "max_new_tokens": MAX_NEW_TOKENS},
                            concurrency=CLIENTS, requests=len(texts), timeout=600.0)
            runs = []
            run_load(LoadSpec(address=address, inputs=texts, overrides=spec.overrides, concurrency=CLIENTS,
                              requests=CLIENTS, timeout=600.0))  # warm
            for _ in range(args.rounds):
                before = _cpu(processes) | {"load generator": _own_cpu()}
                report = run_load(spec)
                after = _cpu(processes) | {"load generator": _own_cpu()}
                spent = {name: after[name] - before[name] for name in after}
                runs.append((report.output_tokens / report.wall_s, spent))
                print(f"services {label}: {runs[-1][0]:.0f} tok/s, CPU s {spent}", file=sys.stderr)
            rate = statistics.median(r for r, _ in runs)
            shares = {name: statistics.median(s[name] / sum(s.values()) for _, s in runs) for name in runs[0][1]}
            ceiling = statistics.median(r * sum(s.values()) / s["verifier"] for r, s in runs)
            lines.append(f"| {label} | {rate:.0f} | {rate / in_process:.2f}x | {rate / same_shape:.2f}x | "
                         f"{shares['load generator']:.0%} | "
                         f"{shares['gateway']:.0%} | {shares['verifier']:.0%} | {shares['drafter']:.0%} | "
                         f"{ceiling:.0f} | {ceiling / in_process:.2f}x |")
    finally:
        proc.terminate()
        proc.wait(60)
    return lines


def _service_processes(gateway_pid: int) -> dict[str, int]:
    """The stack's processes by role: `serve all` runs the gateway and starts the others."""
    out = {"gateway": gateway_pid}
    for task in Path(f"/proc/{gateway_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            for role in ("verifier", "drafter"):
                if role.encode() in cmdline:
                    out[role] = int(child)
    return out


def _cpu(processes: dict[str, int]) -> dict[str, float]:
    """Each process's user and system CPU seconds so far (all its threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in processes.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


if __name__ == "__main__":
    raise SystemExit(main())
