"""A process's first bulk run against its next ones: what a user running one file meets.

    python bench/bench_first_run.py            # print the table
    python bench/bench_first_run.py --write    # also replace the "First run of a process (CPU)" section

Each engine in `--processes` fresh child processes, one after another (never two at once): the
models are loaded (not timed), then the first `--sentences` UA-GEC test sentences are decoded three
times in a row, each run timed alone; output tokens/s of the first run and the best of the other two.
specdec: `Engine.load(workers=2, precision="int8")` and `generate_each` at its "Bulk decoding" best
settings (AR batch 64, IAD k=32 batch 32, two workers), as `specdec decode --workers 2` runs them;
CTranslate2: `translate_batch` int8, 2x1 threads, max_batch_size 64 tokens. The first run pays for
what the process has not made yet: buffers of the rows' K/V (memory touched for the first time),
ONNX Runtime's arenas, threads.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import bench_parser, machine_stamp, publish

REPO = Path(__file__).resolve().parents[1]
SECTION = "## First run of a process (CPU)"
RUNS = 3  # timed runs per process: the first, then the two after it
# (row label, engine, decoding parameters, batch size)
ROWS = [("specdec AR greedy, batch 64, 2 workers", "specdec", {"mode": "ar"}, 64),
        ("specdec IAD k=32, batch 32, 2 workers", "specdec", {"mode": "iad", "k": 32}, 32),
        ("CTranslate2 translate_batch, int8, 2x1 threads, max_batch_size 64 tokens", "ct2", {}, 64)]


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, REPO)
    p.add_argument("--sentences", type=int, default=200, help="UA-GEC test sentences (default: 200)")
    p.add_argument("--processes", type=int, default=5, help="fresh processes per row (default: 5)")
    args = p.parse_args(argv)
    lines = ["| engine and setting | first run, tokens/s (median) | later runs (median of each process's best) | "
             "first / later |", "|---|---:|---:|---:|"]
    rates: dict[str, tuple[list[float], list[float]]] = {label: ([], []) for label, *_ in ROWS}
    for _ in range(args.processes):  # rows interleaved, so the machine's drift hits all alike
        for label, engine, params, batch in ROWS:
            runs = _child(args, engine, params, batch)
            rates[label][0].append(runs[0])
            rates[label][1].append(max(runs[1:]))
    for label, (first, later) in rates.items():
        a, b = statistics.median(first), statistics.median(later)
        lines.append(f"| {label} | {a:.0f} | {b:.0f} | {a / b:.2f}x |")
    return publish(args, SECTION, machine_stamp("int8, each engine in fresh processes"),
                   f"First {args.sentences} UA-GEC test sentences, max_new_tokens 200; {args.processes} fresh "
                   f"processes per row, each timing {RUNS} runs in a row after loading (module docstring of "
                   "`bench/bench_first_run.py`).", lines)


def _child(args, engine: str, params: dict, batch: int) -> list[float]:
    out = subprocess.run([sys.executable, __file__, "--child", args.bundle, args.data_dir or "", str(args.sentences),
                          engine, json.dumps(params), str(batch)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_child(bundle: str, data_dir: str, sentences: str, engine: str, params: str, batch: str) -> None:
    """Prints the output tokens/s of RUNS runs in a row, as JSON."""
    import time

    from evaluation.loadtest import ua_gec_texts

    texts = ua_gec_texts(int(sentences), data_dir or None)
    size = int(batch)
    if engine == "ct2":
        import ctranslate2

        from bench.bench_bulk import CT2_TOKENS_PER_EXAMPLE, MAX_NEW_TOKENS, ct2_inputs
        from seq2seq_models.bundle import load_bundle

        ct2_dir, _, tokens = ct2_inputs(load_bundle(bundle), texts)
        translator = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="int8", inter_threads=2,
                                            intra_threads=1)

        def once() -> int:
            results = translator.translate_batch(tokens, max_batch_size=size * CT2_TOKENS_PER_EXAMPLE,
                                                 batch_type="tokens", beam_size=1,
                                                 max_decoding_length=MAX_NEW_TOKENS, return_end_token=False)
            return sum(len(r.hypotheses[0]) for r in results)
    else:
        import specdec
        from bench.bench_bulk import MAX_NEW_TOKENS

        model = specdec.Engine.load(bundle, precision="int8", workers=2)
        requests = [model.request(t, "", {**json.loads(params), "max_new_tokens": MAX_NEW_TOKENS}) for t in texts]

        def once() -> int:
            return sum(len(o.output_ids) for _, o in model.generate_each(requests, batch_size=size, workers=2))

    rates = []
    for _ in range(RUNS):
        started = time.perf_counter()
        tokens_out = once()
        rates.append(tokens_out / (time.perf_counter() - started))
    print(json.dumps(rates))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _run_child(*sys.argv[2:])
    else:
        raise SystemExit(main())
