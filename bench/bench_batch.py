"""Per-row cost of one batched forward against one-row calls, on a trained bundle's models: the
verifier's verify step (`verifier`, ONNX Runtime CPU) or the NAR drafter's block draft (`nar-drafter`).

    python bench/bench_batch.py verifier [--bundle bundles/ua-gec] [--batches 1,4,16,32] [--blocks 1,11]
                                         [--repeats 20]
    python bench/bench_batch.py nar-drafter [--bundle bundles/ua-gec] [--batches 1,4,16,32] [--k 10]
                                            [--backends onnxruntime,torch] [--repeats 20]

Both: for each batch size B, B sessions over 30-token sources with a 30-token cached prefix; every
step keeps the same prefix (committed_len = the prefix), so lengths stay put. Times are the median
of `--repeats` rounds, per row, in milliseconds.

verifier: for each block size (1 = an AR step; 11 = a GAD block: one appended token and 10 drafted),

* "one-row": B `step_batch` calls of one item each (the one-row graph, `decoder.onnx`, over the
  row's slot in the pool: what a lone session costs);
* "batched": ONE `step_batch` over the B sessions (one call of `decoder_batch.onnx`, or of
  `decoder_step.onnx` for one-token blocks);

"speed-up" = one-row / batched.

nar-drafter: for each backend, every step appends one token and drafts k masks (a GAD step's block:
1 + k tokens),

* "one-row": B `draft_block` calls (ONNX Runtime: the unpadded one-row graph; torch: the batched
  decoder at B = 1);
* "batched": ONE `draft_batch` over the B sessions (`decoder_batch.onnx` on ONNX Runtime);

"speed-up" = one-row / batched. Run one backend per process (`--backends torch`): with ONNX
Runtime's sessions open in the same process, eager torch ran ~70x slower on the 2-core CPU box.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from core.interfaces import BlockCall, StepCall
from evaluation.bench_report import median_seconds
from seq2seq_models.bundle import load_bundle

PREFIX, SOURCE_LEN = 30, 30


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    return args.run(args)


def verifier_main(args: argparse.Namespace) -> int:
    from verifier_service.onnx_backend import OnnxVerifier

    np.seterr(all="ignore")
    bundle = load_bundle(args.bundle, roles=["verifier"])
    cache = args.cache or tempfile.mkdtemp(prefix="specdec-onnx-")
    verifier = OnnxVerifier.from_bundle(bundle, cache_root=cache, intra_op_threads=args.threads)
    rng = random.Random(0)
    print(f"verifier {bundle.verifier.config.d_model}d, {bundle.verifier.config.decoder_layers} decoder layers; "
          f"prefix {PREFIX}, source {SOURCE_LEN}; ms per row (median of {args.repeats})")
    print(f"{'block':>5} {'B':>4} {'one-row':>9} {'batched':>9} {'speed-up':>9}")
    for block in args.blocks:
        for b in args.batches:
            one, batched = (1000 * t / b for t in _measure_verifier(verifier, block, b, rng, args.repeats))
            print(f"{block:>5} {b:>4} {one:>9.3f} {batched:>9.3f} {one / batched:>8.1f}x", flush=True)
    return 0


def nar_drafter_main(args: argparse.Namespace) -> int:
    import torch

    from drafter_service.session import make_drafter

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
        _measure_nar_drafter(drafter, max(args.batches), args.k, rng, 1)
        for b in args.batches:
            one, batched = (1000 * t / b for t in _measure_nar_drafter(drafter, b, args.k, rng, args.repeats))
            print(f"{backend:>12} {b:>4} {one:>9.3f} {batched:>9.3f} {one / batched:>8.1f}x", flush=True)
    return 0


def _measure_verifier(verifier, block: int, b: int, rng: random.Random, repeats: int) -> tuple[float, float]:
    """Seconds for B rows' steps of `block` tokens: one at a time, then all in one forward."""
    vocab = verifier.vocab_size

    def words(n: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(n)]

    sources = [words(SOURCE_LEN) for _ in range(b)]
    prefixes = [words(PREFIX) for _ in range(b)]
    calls = [StepCall(PREFIX, words(1), words(block - 1), 1) for _ in range(b)]
    sessions = [verifier.open(s) for s in sources]
    for s, p in zip(sessions, prefixes, strict=True):
        s.step(0, p, [], 1)
    items = list(zip(sessions, calls, strict=True))
    return (
        median_seconds(lambda: [verifier.step_batch([item]) for item in items], repeats),
        median_seconds(lambda: verifier.step_batch(items), repeats),
    )


def _measure_nar_drafter(drafter, b: int, k: int, rng: random.Random, repeats: int) -> tuple[float, float]:
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="role", required=True)
    verifier = sub.add_parser("verifier", help="the verifier's verify step (ONNX Runtime)")
    verifier.add_argument("--blocks", type=ints, default=[1, 11], help="tokens a row per step (default 1,11)")
    verifier.set_defaults(run=verifier_main)
    nar = sub.add_parser("nar-drafter", help="the NAR drafter's block draft")
    nar.add_argument("--k", type=int, default=10, help="masks drafted a step (default 10)")
    nar.add_argument("--backends", type=lambda s: s.split(","), default=["onnxruntime", "torch"],
                     help="comma-separated (default onnxruntime,torch)")
    nar.set_defaults(run=nar_drafter_main)
    for role in (verifier, nar):
        role.add_argument("--bundle", default=str(Path(__file__).resolve().parents[1] / "bundles" / "ua-gec"))
        role.add_argument("--batches", type=ints, default=[1, 4, 16, 32], help="sessions per forward (default "
                          "1,4,16,32)")
        role.add_argument("--repeats", type=int, default=20, help="rounds timed, median taken (default 20)")
        role.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: the runner's)")
        role.add_argument("--cache", default=None, help="ONNX export cache (default: a fresh temporary directory)")
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
