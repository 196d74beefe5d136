"""Model workers as threads of one process against processes of their own, in-process bulk AR.

    python bench/bench_lanes.py            # print the table
    python bench/bench_lanes.py --write    # also replace the "Model workers: threads and processes (CPU)" section

Two measurements, each in fresh child processes (the models loaded and warmed up before timing):

* Bulk AR greedy over the first `--sentences` UA-GEC test sentences (int8, one intra-op thread per
  worker, output tokens/s): one process with one model worker at batch B/2; one process with two
  (`Engine.bulk(workers=2)`, batch B); and two processes of one worker at batch B/2 each, each over
  half the sentences (every other one by length), started together: their output tokens over the
  wall time until both are done, as a process per worker would decode the whole set. Rounds
  interleave the three.
* One 32-row AR step forward of the int8 step graph (past and source 30 positions, its K/V read
  from copies of the inputs in turn, as a run meets them), milliseconds per call: in one process
  alone, then in two processes side by side (each its own copy of the inputs); and the same for
  CTranslate2 (`translate_batch` of 32 sentences, 40 tokens at most, one thread), to tell whether
  two forwards side by side slow each other through memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import machine_stamp, write_section

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Model workers: threads and processes (CPU)"
FORWARD_S = 5.0  # seconds each side-by-side measurement runs for


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", default=str(REPO / "bundles" / "ua-gec"), help="the bundle (default: the shipped one)")
    p.add_argument("--sentences", type=int, default=200, help="UA-GEC test sentences (default: 200)")
    p.add_argument("--batch", type=int, default=64, help="B: rows in flight over the two workers (default: 64)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    p.add_argument("--write", action="store_true", help="replace the section of BENCHMARKS.md")
    args = p.parse_args(argv)
    bulk = _bulk(args)
    forwards = _forwards(args.bundle)
    lines = ["| workers | output tokens/s (median) | best |", "|---|---:|---:|"]
    for label, rates in bulk.items():
        lines.append(f"| {label} | {statistics.median(rates):.0f} | {max(rates):.0f} |")
    lines += ["", "| forward | alone, ms | two processes side by side, ms | side by side / alone |",
              "|---|---:|---:|---:|"]
    for label, (alone, both) in forwards.items():
        lines.append(f"| {label} | {alone:.2f} | {both:.2f} | {both / alone:.2f}x |")
    body = "\n".join([
        machine_stamp("int8 (specdec: ONNX Runtime), one intra-op thread per worker"), "",
        f"Bulk AR greedy, first {args.sentences} UA-GEC test sentences, {args.rounds} interleaved rounds; "
        "one step forward alone and beside another process's (module docstring of `bench/bench_lanes.py`).", "",
        *lines,
    ])
    print(f"{SECTION}\n\n{body}")
    if args.write:
        write_section(REPO / "BENCHMARKS.md", SECTION, body)
    return 0


def _bulk(args: argparse.Namespace) -> dict[str, list[float]]:
    half = args.batch // 2
    one = _child("bulk", args.bundle, str(args.sentences), str(half), "1", "0/1")
    two = _child("bulk", args.bundle, str(args.sentences), str(args.batch), "2", "0/1")
    pair = [_child("bulk", args.bundle, str(args.sentences), str(half), "1", f"{i}/2") for i in range(2)]
    rates: dict[str, list[float]] = {
        f"1 process, 1 worker (batch {half})": [],
        f"1 process, 2 workers (batch {args.batch})": [],
        f"2 processes, 1 worker each (batch {half} each, half the sentences each)": [],
    }
    labels = list(rates)
    try:
        for _ in range(args.rounds):
            for label, children in zip(labels, ([one], [two], pair), strict=True):
                runs = _ask(children)  # each child's [started, ended, output tokens]
                rates[label].append(sum(r[2] for r in runs) / (max(r[1] for r in runs) - min(r[0] for r in runs)))
    finally:
        for child in (one, two, *pair):
            child.kill()
    return rates


def _forwards(bundle: str) -> dict[str, tuple[float, float]]:
    out = {}
    for kind, label in (("step", "specdec 32-row AR step (int8 step graph)"),
                        ("ct2", "CTranslate2 translate_batch, 32 sentences")):
        a, b = (_child(kind, bundle, str(FORWARD_S)) for _ in range(2))
        try:
            alone = _ask([a])[0]
            both = statistics.mean(_ask([a, b]))
            out[label] = (alone, both)
        finally:
            a.kill()
            b.kill()
    return out


def _child(*argv: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--child", *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _ask(children: list[subprocess.Popen]) -> list:
    """Every child measures once, at the same time; their figures (JSON)."""
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    return [json.loads(child.stdout.readline()) for child in children]  # type: ignore[union-attr]


# ---- children ---------------------------------------------------------------------------------------


def _serve(measure) -> None:
    print("ready", flush=True)
    for _ in sys.stdin:
        print(json.dumps(measure()), flush=True)


def _bulk_child(bundle: str, sentences: str, batch: str, workers: str, part: str) -> None:
    """`part` "i/n": the i-th of n shares of the sentences (every n-th by length, longest first)."""
    import time

    import specdec
    from evaluation.loadtest import ua_gec_texts

    texts = ua_gec_texts(int(sentences), None)
    share, shares = (int(x) for x in part.split("/"))
    texts = sorted(texts, key=len, reverse=True)[share::shares]
    engine = specdec.Engine.load(bundle, precision="int8")

    def measure() -> list[float]:
        """[started, ended] (the wall clock, which the processes share) and the output tokens."""
        requests = [engine.request(t, "", {"mode": "ar"}) for t in texts]
        started = time.time()
        outputs = [o.output_ids for _, o in engine.generate_each(requests, batch_size=int(batch),
                                                                 workers=int(workers), threads=1)]
        return [started, time.time(), sum(map(len, outputs))]

    measure()
    measure()
    _serve(measure)


def _step_child(bundle: str, seconds: str) -> None:
    import numpy as np

    import specdec
    from bench.bench_bulk import captured_ar_step
    from seq2seq_models.ort_runner import inference_session

    engine = specdec.Engine.load(bundle, precision="int8")
    copies = [{k: v.copy() if isinstance(v, np.ndarray) else v for k, v in captured_ar_step(engine).items()}
              for _ in range(3)]
    session = inference_session(Path(engine.verifier.engine.runner.step_decoder._model_path), 1,
                                ["CPUExecutionProvider"])
    _serve(_timed(lambda i: session.run(None, copies[i % len(copies)]), float(seconds)))


def _ct2_child(bundle: str, seconds: str) -> None:
    import ctranslate2

    from bench.bench_bulk import ct2_inputs
    from evaluation.loadtest import ua_gec_texts
    from seq2seq_models.bundle import load_bundle

    ct2_dir, _, tokens = ct2_inputs(load_bundle(bundle), ua_gec_texts(32, None))
    translator = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="int8", inter_threads=1,
                                        intra_threads=1)
    _serve(_timed(lambda i: translator.translate_batch(tokens, max_batch_size=32, beam_size=1,
                                                       max_decoding_length=40), float(seconds)))


def _timed(call, seconds: float):
    """A measure: calls for `seconds`, milliseconds per call (after three unmeasured ones)."""
    import time

    for i in range(3):
        call(i)

    def measure() -> float:
        started, n = time.perf_counter(), 0
        while time.perf_counter() - started < seconds:
            call(n)
            n += 1
        return (time.perf_counter() - started) / n * 1000

    return measure


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, *rest = sys.argv[2:]
        {"bulk": _bulk_child, "step": _step_child, "ct2": _ct2_child}[kind](*rest)
    else:
        raise SystemExit(main())
