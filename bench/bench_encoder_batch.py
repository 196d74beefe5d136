"""The encoder runs of new sessions: one source at a time, one padded run, or runs split by length.

    python bench/bench_encoder_batch.py               # prints the table
    python bench/bench_encoder_batch.py --write       # also replaces its section of BENCHMARKS.md

A model service encodes the sources of the sessions opened while its worker was busy together
(`seq2seq_models.row_cache.encode_new`). This measures what that saves per source on the bundle's
verifier encoder (ONNX Runtime, the service's threads): UA-GEC test sources taken B at a time in
corpus order, each group encoded (a) one source per run, (b) in one run padded to the group's
longest source, (c) as the services do, in runs split by length where the padding would cost
more than a run (`core.batch_slots.split_by_length` with the CPU's `SPLIT_SOURCE_TOKENS_CPU`).
Median ms per source over the groups' passes, interleaved.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from core.batch_slots import split_by_length, split_source_tokens_for
from evaluation.bench_report import bench_parser, machine_stamp, write_section
from evaluation.loadtest import ua_gec_texts
from seq2seq_models.bundle import load_bundle
from seq2seq_models.onnx_cache import bundle_cache_root
from seq2seq_models.onnx_export import ensure_export
from seq2seq_models.ort_engine import OrtBatchEngine
from seq2seq_models.ort_runner import open_runner

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Encoder runs of new sessions (CPU)"


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, ROOT)
    p.add_argument("--sentences", type=int, default=256)
    p.add_argument("--groups", default="1,2,4,8,16", help="sources per group (B)")
    p.add_argument("--passes", type=int, default=3)
    args = p.parse_args(argv)
    bundle = load_bundle(args.bundle, roles=["verifier"])
    export = ensure_export(bundle.verifier, bundle.fingerprint, bundle_cache_root(Path(args.bundle)))
    engine = OrtBatchEngine(open_runner(export), bundle.verifier.config.eos_id)
    split = split_source_tokens_for("cpu")
    sources = [bundle.tokenizer.encode(t) for t in ua_gec_texts(args.sentences, args.data_dir)]
    rows = [_measure(engine, sources, int(b), split, args.passes) for b in args.groups.split(",")]
    table = _table(rows)
    print(table)
    if args.write:
        note = (f"Bundle: {Path(args.bundle).name}, its verifier's encoder on ONNX Runtime (`encoder.onnx`, fp32); the "
                f"first {len(sources)} UA-GEC test sources (tokens per source: median "
                f"{statistics.median(len(s) for s in sources):.0f}, longest {max(len(s) for s in sources)}) in groups "
                f"of B in corpus order; ms per source, the median of {args.passes} interleaved passes. Split: runs "
                f"grouped by length with a run's fixed cost at {split} tokens, as the verifier and the drafter do.")
        write_section(args.output, SECTION, f"{machine_stamp()}\n\n{note}\n\n{table}")
    return 0


def _measure(engine: OrtBatchEngine, sources: list[list[int]], b: int, split: int, passes: int) -> dict:
    groups = [sources[i : i + b] for i in range(0, len(sources) - b + 1, b)]
    ways = {
        "alone": lambda g: [engine.encode_batch([s]) for s in g],
        "padded": lambda g: engine.encode_batch(g),
        "split": lambda g: [engine.encode_batch([g[i] for i in part])
                            for part in split_by_length([len(s) + 1 for s in g], split)],
    }
    for way in ways.values():  # warm: ONNX Runtime plans each new shape once
        way(groups[0])
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(passes):
        for name, way in ways.items():
            t0 = time.perf_counter()
            for g in groups:
                way(g)
            times[name].append((time.perf_counter() - t0) * 1000 / (len(groups) * b))
    return {"b": b, **{name: statistics.median(t) for name, t in times.items()}}


def _table(rows: list[dict]) -> str:
    lines = ["| B | one source a run, ms / source | one padded run | runs split by length | split vs one a run |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['b']} | {r['alone']:.2f} | {r['padded']:.2f} | {r['split']:.2f} | "
                     f"{r['alone'] / r['split']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
