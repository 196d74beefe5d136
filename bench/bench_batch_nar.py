"""Per-row cost of one batched NAR block draft against one-row drafts (trained NAR drafter).

    python bench/bench_batch_nar.py [--bundle bundles/ua-gec] [--batches 1,4,16,32] [--k 10]
                                    [--backends onnxruntime,torch] [--repeats 20]

For each backend and batch size B, B sessions over 30-token sources with a 30-token prefix; every
step keeps the prefix, appends one token and drafts k masks (a GAD step's block: 1 + k tokens):

* "one-row": B `draft_block` calls (ONNX Runtime: the unpadded one-row graph; torch: the batched
  decoder at B = 1);
* "batched": ONE `draft_batch` over the B sessions (`decoder_batch.onnx` on ONNX Runtime).

Times are the median of `--repeats` rounds, per row, in milliseconds; "speed-up" = one-row / batched.
Run one backend per process (`--backends torch`): with ONNX Runtime's sessions open in the same
process, eager torch ran ~70x slower on the 2-core CPU box.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from core.interfaces import BlockCall
from drafter_service.session import LocalDrafter, make_drafter
from evaluation.bench_report import median_seconds
from seq2seq_models.bundle import load_bundle

PREFIX, SOURCE_LEN = 30, 30


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    bundle = load_bundle(args.bundle, roles=["nar_drafter"])
    cfg = bundle.nar_drafter.config
    cache = args.cache or tempfile.mkdtemp(prefix="specdec-onnx-")
    print(f"NAR drafter {cfg.d_model}d, {cfg.decoder_layers} decoder layers; prefix {PREFIX}, source {SOURCE_LEN}, "
          f"k {args.k}; ms per row (median of {args.repeats}); torch threads {torch.get_num_threads()}")
    print(f"{'backend':>12} {'B':>4} {'one-row':>9} {'batched':>9} {'speed-up':>9}")
    for backend in args.backends:
        options = {"cache_root": cache, "intra_op_threads": args.threads} if backend == "onnxruntime" else {}
        drafter = make_drafter(bundle, backend, **options)
        assert drafter is not None
        rng = random.Random(0)
        # An untimed round first: eager torch's first calls of a process were ~70x slower for a while
        # (seen on the 2-core CPU box), which skewed whichever batch size came first.
        _measure(drafter, max(args.batches), args.k, rng, 1)
        for b in args.batches:
            one, batched = (1000 * t / b for t in _measure(drafter, b, args.k, rng, args.repeats))
            print(f"{backend:>12} {b:>4} {one:>9.3f} {batched:>9.3f} {one / batched:>8.1f}x", flush=True)
    return 0


def _measure(drafter: LocalDrafter, b: int, k: int, rng: random.Random, repeats: int) -> tuple[float, float]:
    """Seconds for B sessions' block drafts: one at a time, then all in one forward."""

    def words(n: int) -> list[int]:
        return [rng.randrange(5, drafter.vocab_size) for _ in range(n)]

    sessions = [drafter.open(words(SOURCE_LEN)) for _ in range(b)]
    for s in sessions:
        s.draft_block(0, words(PREFIX), 1)
    items = [(s, BlockCall(PREFIX, words(1), k)) for s in sessions]
    return (
        median_seconds(lambda: [s.draft_block(c.committed_len, c.append_ids, c.k) for s, c in items], repeats),
        median_seconds(lambda: drafter.draft_batch(items), repeats),
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", default=str(Path(__file__).resolve().parents[1] / "bundles" / "ua-gec"))
    p.add_argument("--batches", type=ints, default=[1, 4, 16, 32])
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--backends", type=lambda s: s.split(","), default=["onnxruntime", "torch"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: the runner's)")
    p.add_argument("--cache", default=None, help="ONNX export cache (default: a fresh temporary directory)")
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
