"""Model workers as threads of one process against processes of their own, in-process bulk AR, and
what each engine gains from its second core.

    python bench/bench_lanes.py            # print the table
    python bench/bench_lanes.py --write    # also replace the "Model workers: threads and processes (CPU)" section

Two measurements, each in fresh child processes (the models loaded and warmed up before timing):

* Bulk AR greedy over the first `--sentences` UA-GEC test sentences (int8, one intra-op thread per
  worker, output tokens/s): one process with one model worker at batch B/2; one process with two
  (`Engine.bulk(workers=2)`, batch B); and two processes of one worker at batch B/2 each, each over
  half the sentences (every other one by length), started together: their output tokens over the
  wall time until both are done, as a process per worker would decode the whole set. In the same
  rounds, CTranslate2's `translate_batch` over all the sentences (int8, `max_batch_size` 64 of
  batch_type tokens, its best cell in "Bulk decoding") with one translator of one thread (1x1) and
  two (2x1): each engine's two cores against its one (specdec: two workers against one).
* One model worker beside a memory-bound process (a copy of 256 MB arrays in a loop, on the other
  core), against alone: specdec's one worker at batch B/2 and CTranslate2 at 1x1, in the same
  rounds, to tell whether either engine's forwards lean harder on the memory the cores share.
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
CT2_BATCH = 64  # CTranslate2's max_batch_size, batch_type "tokens" (bench_bulk's CT2_TOKENS_PER_EXAMPLE each)
HOG_FLOATS = 64 << 20  # the memory-bound process's arrays: 256 MB each, far past any cache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", default=str(REPO / "bundles" / "ua-gec"), help="the bundle (default: the shipped one)")
    p.add_argument("--sentences", type=int, default=200, help="UA-GEC test sentences (default: 200)")
    p.add_argument("--batch", type=int, default=64, help="B: rows in flight over the two workers (default: 64)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    p.add_argument("--write", action="store_true", help="replace the section of BENCHMARKS.md")
    args = p.parse_args(argv)
    bulk, cores, memory = _bulk(args)
    forwards = _forwards(args.bundle)
    lines = ["| workers | output tokens/s (median) | best |", "|---|---:|---:|"]
    for label, rates in bulk.items():
        lines.append(f"| {label} | {statistics.median(rates):.0f} | {max(rates):.0f} |")
    lines += ["", "| engine | one core, tokens/s (median) | two cores | two / one |", "|---|---:|---:|---:|"]
    for label, (one, two) in cores.items():
        lines.append(f"| {label} | {statistics.median(one):.0f} | {statistics.median(two):.0f} | "
                     f"{statistics.median(two) / statistics.median(one):.2f}x |")
    lines += ["", "| one core | alone, tokens/s (median) | beside a memory-bound process | beside / alone |",
              "|---|---:|---:|---:|"]
    for label, (alone, beside) in memory.items():
        lines.append(f"| {label} | {statistics.median(alone):.0f} | {statistics.median(beside):.0f} | "
                     f"{statistics.median(beside) / statistics.median(alone):.2f}x |")
    lines += ["", "| forward | alone, ms | two processes side by side, ms | side by side / alone |",
              "|---|---:|---:|---:|"]
    for label, (alone, both) in forwards.items():
        lines.append(f"| {label} | {alone:.2f} | {both:.2f} | {both / alone:.2f}x |")
    body = "\n".join([
        machine_stamp("int8 (specdec: ONNX Runtime), one intra-op thread per worker"), "",
        f"Bulk AR greedy, first {args.sentences} UA-GEC test sentences, {args.rounds} interleaved rounds; "
        f"CTranslate2 int8 at max_batch_size {CT2_BATCH} tokens; one core beside a memory-bound process; "
        "one step forward alone and beside another process's (module docstring of `bench/bench_lanes.py`).", "",
        *lines,
    ])
    print(f"{SECTION}\n\n{body}")
    if args.write:
        write_section(REPO / "BENCHMARKS.md", SECTION, body)
    return 0


def _bulk(args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, tuple[list[float], list[float]]],
                                             dict[str, tuple[list[float], list[float]]]]:
    """The bulk rounds: specdec's workers as threads and processes; each engine on one and two cores;
    one core alone and beside the memory-bound process."""
    half = args.batch // 2
    one = _child("bulk", args.bundle, str(args.sentences), str(half), "1", "0/1")
    two = _child("bulk", args.bundle, str(args.sentences), str(args.batch), "2", "0/1")
    pair = [_child("bulk", args.bundle, str(args.sentences), str(half), "1", f"{i}/2") for i in range(2)]
    ct2_one, ct2_two = (_child("ct2bulk", args.bundle, str(args.sentences), str(n)) for n in (1, 2))
    rates: dict[str, list[float]] = {
        f"1 process, 1 worker (batch {half})": [],
        f"1 process, 2 workers (batch {args.batch})": [],
        f"2 processes, 1 worker each (batch {half} each, half the sentences each)": [],
    }
    labels = list(rates)
    ct2 = {1: [], 2: []}
    beside: dict[str, list[float]] = {"specdec": [], "CTranslate2": []}
    try:
        for _ in range(args.rounds):
            for label, children in zip(labels, ([one], [two], pair), strict=True):
                rates[label].append(_rate(_ask(children)))
            for n, child in ((1, ct2_one), (2, ct2_two)):
                ct2[n].append(_rate(_ask([child])))
            hog = subprocess.Popen([sys.executable, __file__, "--child", "hog"])
            try:
                beside["specdec"].append(_rate(_ask([one])))
                beside["CTranslate2"].append(_rate(_ask([ct2_one])))
            finally:
                hog.kill()
                hog.wait()
    finally:
        for child in (one, two, *pair, ct2_one, ct2_two):
            child.kill()
    cores = {f"specdec (1 worker, batch {half}; 2 workers, batch {args.batch})": (rates[labels[0]], rates[labels[1]]),
             "CTranslate2 (1x1 threads; 2x1)": (ct2[1], ct2[2])}
    memory = {f"specdec, 1 worker (batch {half})": (rates[labels[0]], beside["specdec"]),
              "CTranslate2, 1x1 threads": (ct2[1], beside["CTranslate2"])}
    return rates, cores, memory


def _rate(runs: list) -> float:
    """Output tokens per second of children's runs (each [started, ended, output tokens]) taken together."""
    return sum(r[2] for r in runs) / (max(r[1] for r in runs) - min(r[0] for r in runs))


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


def _ct2_bulk_child(bundle: str, sentences: str, inter: str) -> None:
    import time

    import ctranslate2

    from bench.bench_bulk import CT2_TOKENS_PER_EXAMPLE, MAX_NEW_TOKENS, ct2_inputs
    from evaluation.loadtest import ua_gec_texts
    from seq2seq_models.bundle import load_bundle

    ct2_dir, _, tokens = ct2_inputs(load_bundle(bundle), ua_gec_texts(int(sentences), None))
    translator = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="int8", inter_threads=int(inter),
                                        intra_threads=1)

    def measure() -> list[float]:
        started = time.time()
        results = translator.translate_batch(tokens, max_batch_size=CT2_BATCH * CT2_TOKENS_PER_EXAMPLE,
                                             batch_type="tokens", beam_size=1, max_decoding_length=MAX_NEW_TOKENS,
                                             return_end_token=False)
        return [started, time.time(), sum(len(r.hypotheses[0]) for r in results)]

    measure()
    _serve(measure)


def _hog_child() -> None:
    """Copies one large array into another until killed: memory traffic, on a core of its own."""
    import numpy as np

    source = np.ones(HOG_FLOATS, np.float32)
    target = np.empty_like(source)
    while True:
        np.copyto(target, source)


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
        {"bulk": _bulk_child, "step": _step_child, "ct2": _ct2_child, "ct2bulk": _ct2_bulk_child,
         "hog": _hog_child}[kind](*rest)
    else:
        raise SystemExit(main())
