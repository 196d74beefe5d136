"""Adaptive speculation at one request at a time, in-process on the UA-GEC bundle: AR greedy, GAD
k=10 and GAD k=10 with `adaptive` (the block length chosen per step, up to 10), decoded by
`evaluation.benchmark` (interleaved rounds, lossless check against greedy), then one more untimed
pass of the adaptive row for the block lengths it chose.

    python bench/bench_adaptive.py [--sample 50] [--backend onnxruntime] [--k 10]

The issue's target: adaptive GAD at >= 0.95x fixed-k GAD's throughput at one client.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.benchmark import GREEDY, BenchConfig, _decoding_config, format_table, run_benchmark


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, default=Path("bundles/ua-gec"))
    p.add_argument("--sample", type=int, default=50)
    p.add_argument("--backend", default="onnxruntime")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=200)
    args = p.parse_args()

    from decoding.decode import decode
    from evaluation.benchmark import _make_drafter, _make_verifier, select_sentences
    from seq2seq_models.bundle import load_bundle
    from training.data import load_test_set

    fixed = BenchConfig(f"GAD k={args.k}", {"mode": "gad", "k": args.k})
    adaptive = BenchConfig(f"GAD k={args.k} adaptive", {"mode": "gad", "k": args.k, "adaptive": True})
    configs = [BenchConfig(GREEDY, {"mode": "ar"}), fixed, adaptive]
    items = load_test_set()
    result = run_benchmark(args.bundle, items, configs, ("in-process",), args.backend, args.max_new_tokens,
                           progress=lambda line: print(line, file=sys.stderr, flush=True), limit=args.sample)
    print(format_table(result))
    for note in result.notes:
        print(note)
    rows = {r.name: r for r in result.rows}
    ratio = rows[fixed.name].wall_s / rows[adaptive.name].wall_s
    print(f"\nadaptive / fixed throughput: {ratio:.3f}x (target >= 0.95x); "
          f"adaptive / greedy: {rows[GREEDY].wall_s / rows[adaptive.name].wall_s:.2f}x")

    # Which block lengths the adaptive policy ran (a fresh verifier: its own load model).
    bundle = load_bundle(args.bundle)
    verifier, drafter = _make_verifier(bundle, args.backend), _make_drafter(bundle, args.backend)
    sentences = select_sentences(items, bundle.tokenizer, verifier.max_source_len, args.sample)
    cfg = _decoding_config(adaptive, min(args.max_new_tokens, verifier.max_target_len))
    counts: list[int] = []
    for s in sentences:
        steps = decode(s.source_ids, cfg, verifier, drafter).stats.steps_per_draft_length
        counts += [0] * (len(steps) - len(counts))
        for n, c in enumerate(steps):
            counts[n] += c
    total = sum(counts)
    print("steps per draft length (adaptive): " + ", ".join(f"{n}: {c}" for n, c in enumerate(counts) if c)
          + f"; mean {sum(n * c for n, c in enumerate(counts)) / total:.2f} over {total} steps")
    return 0 if result.lossless_ok else 1


if __name__ == "__main__":
    sys.exit(main())
