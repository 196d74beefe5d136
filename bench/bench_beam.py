"""In-process beam 5 against AR greedy on UA-GEC test sentences: what one multi-row verifier
session per request saves over one single-row session per hypothesis.

    python bench/bench_beam.py --sample 50                      # default backend (onnxruntime)
    python bench/bench_beam.py --sample 50 --backend torch

Four rows, decoded sentence by sentence in interleaved rounds (a machine that drifts skews each
alike): AR greedy; beam 5 as it was before multi-row sessions and before it became `generate`'s
search (`tests.beam_reference`, frozen);
beam 5 through `open_rows` (the backend's own `step_rows` when its sessions have it, else the
adapter); beam 5 forced onto the adapter (`RowsOverSessions`: one single-row session per
hypothesis). Prints ms per sentence, the cost relative to greedy, steps per sentence, and how many
outputs each beam row shares with the frozen search (batched float32 arithmetic may flip a
near-tie; each disagreement is listed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from core.backends import BACKENDS, DEFAULT_BACKEND
from core.multirow import has_rows
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.policies.beam import BeamSettings, beam_search
from decoding.policies.loop import DecodeStats
from evaluation.benchmark import select_sentences
from seq2seq_models.bundle import load_bundle
from tests.beam_reference import reference_beam_search
from training.data import load_test_set
from verifier_service.session import make_verifier

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 5
WIDTH = 5


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=REPO / "bundles" / "ua-gec")
    p.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND)
    p.add_argument("--sample", type=int, default=50, help="first N usable test sentences")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    bundle = load_bundle(args.bundle)
    onnx = {"intra_op_threads": args.threads} if args.threads and args.backend == "onnxruntime" else {}
    verifier = make_verifier(bundle, args.backend, **onnx)
    max_new = min(args.max_new_tokens, verifier.max_target_len)
    sentences = select_sentences(load_test_set(None), bundle.tokenizer, verifier.max_source_len, args.sample)
    native = has_rows(verifier.open(sentences[0].source_ids))
    greedy_cfg = DecodingConfig(mode=Mode.AR, max_new_tokens=max_new)

    def greedy(ids):
        res = decode(ids, greedy_cfg, verifier)
        return res.output_ids, res.stats.iterations

    def frozen(ids):
        stats = DecodeStats()
        return reference_beam_search(verifier, ids, WIDTH, max_new, stats), stats.iterations

    def beam(**how):
        def run(ids):
            stats = DecodeStats()
            best = beam_search(verifier, ids, BeamSettings(WIDTH), max_new, stats, **how)[0]
            return best.output_ids, stats.iterations

        return run

    rows = {
        "AR greedy": greedy,
        f"beam {WIDTH}, before multi-row sessions (frozen)": frozen,
        f"beam {WIDTH}, open_rows ({'native step_rows' if native else 'adapter'})": beam(),
        f"beam {WIDTH}, adapter (one session per row)": beam(native_rows=False),
    }
    for one in rows.values():
        for s in sentences[: args.warmup]:
            one(s.source_ids)
    wall = dict.fromkeys(rows, 0.0)
    steps = dict.fromkeys(rows, 0)
    outputs: dict[str, list] = {name: [None] * len(sentences) for name in rows}
    names = list(rows)
    for r in range(ROUNDS):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            for i in range(r, len(sentences), ROUNDS):
                t0 = time.perf_counter()
                out, iterations = rows[name](sentences[i].source_ids)
                wall[name] += time.perf_counter() - t0
                steps[name] += iterations
                outputs[name][i] = out
    n = len(sentences)
    base = wall[names[0]]
    print(f"backend {args.backend}, {n} sentences, max_new_tokens {max_new}, multi-row sessions: {native}")
    print("| decoding | ms / sentence | x greedy | steps / sentence |")
    print("|---|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {wall[name] / n * 1e3:.1f} | {wall[name] / base:.2f} | {steps[name] / n:.1f} |")
    frozen = outputs[names[1]]
    for name in names[2:]:
        differ = [i for i in range(n) if outputs[name][i] != frozen[i]]
        print(f"{name}: output equals the frozen search on {n - len(differ)}/{n} sentences")
        for i in differ:
            print(f"  sentence {i}: {bundle.tokenizer.decode(outputs[name][i])!r} "
                  f"vs {bundle.tokenizer.decode(frozen[i])!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
