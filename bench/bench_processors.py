"""What generate()'s logits processors cost per greedy step.

    python bench/bench_processors.py            # prints the table
    python bench/bench_processors.py --write    # also replaces its section of BENCHMARKS.md

The bundle's greedy (mode ar, one sentence at a time, in-process) over the first `--sentences`
UA-GEC test sentences, without processors and with every processor on (repetition_penalty,
no_repeat_ngram_size, encoder_no_repeat_ngram_size, multi-token bad_words_ids, min_new_tokens,
suppress_tokens, begin_suppress_tokens, forced_eos_token_id), per backend and precision. The
processors change the outputs, so the figure is time per step: a request's total time over its
verifier steps, summed over the sentences; `--rounds` interleaved rounds, the best kept.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import bench_parser, machine_stamp, write_section
from evaluation.loadtest import ua_gec_texts
from seq2seq_models.bundle import load_bundle

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Logits processors (CPU)"
SETUPS = [("onnxruntime", "int8"), ("onnxruntime", "fp32"), ("torch", "fp32")]


def main(argv: list[str] | None = None) -> int:
    import specdec

    p = bench_parser(__doc__, ROOT)
    p.add_argument("--sentences", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=200)
    args = p.parse_args(argv)
    texts = ua_gec_texts(args.sentences, args.data_dir)
    processors = _every_processor(load_bundle(args.bundle, roles=["verifier"]).verifier.config)
    rows = []
    for backend, precision in SETUPS:
        with specdec.Engine.load(args.bundle, backend=backend, precision=precision, threads=1) as engine:
            runs = {"without": {}, "with": processors}
            best = {name: float("inf") for name in runs}
            for params in runs.values():  # warm: each shape planned once
                _ms_per_step(engine, texts[:3], args.max_new_tokens, params)
            for r in range(args.rounds):
                for name, params in runs.items():
                    best[name] = min(best[name], _ms_per_step(engine, texts, args.max_new_tokens, params))
                    print(f"round {r + 1}/{args.rounds} {backend} {precision} {name}: {best[name]:.3f} ms/step",
                          file=sys.stderr)
            rows.append((backend, precision, best["without"], best["with"]))
    table = _table(rows)
    print(table)
    if args.write:
        note = (f"Bundle: {Path(args.bundle).name}; greedy (mode ar), one sentence at a time in-process, one "
                f"intra-op thread; the first {len(texts)} UA-GEC test sentences; ms per verifier step (a "
                f"request's total time over its steps, summed), the best of {args.rounds} interleaved rounds. "
                f"With: {_shown(processors)}.")
        write_section(args.output, SECTION, f"{machine_stamp()}\n\n{note}\n\n{table}")
    return 0


def _every_processor(config) -> dict:
    """Every processor on, with settings that leave most outputs close to greedy's."""
    unk = config.unk_id
    return {
        "repetition_penalty": 1.1, "no_repeat_ngram_size": 4, "encoder_no_repeat_ngram_size": 12,
        "bad_words_ids": [[unk, unk], [unk, unk, unk]], "min_new_tokens": 2, "suppress_tokens": [unk],
        "begin_suppress_tokens": [unk], "forced_eos_token_id": config.eos_id,
    }


def _ms_per_step(engine, texts: list[str], max_new_tokens: int, params: dict) -> float:
    total_ms, steps = 0.0, 0
    for text in texts:
        t0 = time.perf_counter()
        out = engine.generate(text, mode="ar", max_new_tokens=max_new_tokens, **params)
        total_ms += (time.perf_counter() - t0) * 1000
        steps += out.stats.iterations
    return total_ms / max(steps, 1)


def _table(rows: list[tuple[str, str, float, float]]) -> str:
    lines = ["| backend | precision | without processors, ms / step | with every processor | cost |",
             "|---|---|---:|---:|---:|"]
    for backend, precision, without, with_ in rows:
        lines.append(f"| {backend} | {precision} | {without:.3f} | {with_:.3f} | {(with_ / without - 1) * 100:+.1f}% |")
    return "\n".join(lines)


def _shown(params: dict) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in params.items())


if __name__ == "__main__":
    sys.exit(main())
