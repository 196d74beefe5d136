"""Per-row cost of one batched verify forward against one-row steps (trained verifier, ONNX Runtime CPU).

    python bench/bench_batch_forward.py [--bundle bundles/ua-gec] [--batches 1,4,16,32] [--repeats 20]

For each batch size B and block size (1 = an AR step; 11 = a GAD block: one appended token and 10
drafted), B sessions over 30-token sources with a 30-token cached prefix each step:

* "one-row graph": B steps through today's one-row decoder graph (`decoder.onnx`, one call per
  session, the past re-concatenated by the graph as before the batched decoder existed);
* "batched x1": B `step_batch` calls of one item each (the batched graph at B = 1: what a lone
  session costs now);
* "batched": ONE `step_batch` over the B sessions (one call of `decoder_batch.onnx`).

Every step keeps the same prefix (committed_len = the prefix), so lengths stay put. Times are the
median of `--repeats` rounds, per row, in milliseconds; "speed-up" = one-row graph / batched.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from core.interfaces import StepCall
from evaluation.bench_report import median_seconds
from seq2seq_models.bundle import load_bundle
from verifier_service.onnx_backend import OnnxVerifier

PREFIX, SOURCE_LEN = 30, 30


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    bundle = load_bundle(args.bundle, roles=["verifier"])
    cache = args.cache or tempfile.mkdtemp(prefix="specdec-onnx-")
    verifier = OnnxVerifier.from_bundle(bundle, cache_root=cache, intra_op_threads=args.threads)
    rng = random.Random(0)
    print(f"verifier {bundle.verifier.config.d_model}d, {bundle.verifier.config.decoder_layers} decoder layers; "
          f"prefix {PREFIX}, source {SOURCE_LEN}; ms per row (median of {args.repeats})")
    print(f"{'block':>5} {'B':>4} {'one-row graph':>14} {'batched x1':>11} {'batched':>9} {'speed-up':>9}")
    for block in args.blocks:
        for b in args.batches:
            ms = [1000 * t / b for t in _measure(verifier, block, b, rng, args.repeats)]
            print(f"{block:>5} {b:>4} {ms[0]:>14.3f} {ms[1]:>11.3f} {ms[2]:>9.3f} {ms[0] / ms[2]:>8.1f}x", flush=True)
    return 0


def _measure(verifier: OnnxVerifier, block: int, b: int, rng: random.Random, repeats: int) -> list[float]:
    """Seconds for B rows' steps of `block` tokens: one-row graph, batched one at a time, batched together."""
    vocab = verifier.vocab_size

    def words(n: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(n)]

    sources = [words(SOURCE_LEN) for _ in range(b)]
    prefixes = [words(PREFIX) for _ in range(b)]
    calls = [StepCall(PREFIX, words(1), words(block - 1), 1) for _ in range(b)]
    sessions = [verifier.open(s) for s in sources]
    for s, p in zip(sessions, prefixes, strict=True):
        s.step(0, p, [], 1)
    legacy = [_LegacyRow(verifier, s, p) for s, p in zip(sources, prefixes, strict=True)]
    items = list(zip(sessions, calls, strict=True))
    return [
        median_seconds(lambda: [r.step(c) for r, c in zip(legacy, calls, strict=True)], repeats),
        median_seconds(lambda: [verifier.step_batch([item]) for item in items], repeats),
        median_seconds(lambda: verifier.step_batch(items), repeats),
    ]


class _LegacyRow:
    """A session as the one-row ONNX backend ran it before the batched decoder: the one-row graph,
    its past kept as the graph's `present` output (see git history of verifier_service/onnx_backend.py)."""

    def __init__(self, verifier: OnnxVerifier, source: list[int], prefix: list[int]) -> None:
        cfg = verifier.config
        self.runner, self.cfg = verifier.runner, cfg
        self.cross = self.runner.encode(source, cfg.eos_id)
        self.past = self.runner.empty_past(cfg)
        self.tokens: list[int] = []
        self._decode([cfg.bos_id, *prefix], 0, len(prefix), [-1])
        self.tokens = list(prefix)

    def step(self, call: StepCall) -> None:
        seq = [self.cfg.bos_id, *self.tokens[: call.committed_len], *call.append_ids, *call.draft_ids]
        past_len = 1 + call.committed_len
        self._decode(seq[past_len:], past_len, call.committed_len + len(call.append_ids) - past_len,
                     [*call.draft_ids, -1])
        self.tokens = seq[1:]

    def _decode(self, fed: list[int], past_len: int, head_from: int, targets: list[int]) -> None:
        k, v, *_ = self.runner.decode(self.past, self.cross, tokens=[fed], past_len=past_len, head_from=head_from,
                                      targets=targets, top_k=[1])
        self.past = (k, v)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", default=str(Path(__file__).resolve().parents[1] / "bundles" / "ua-gec"))
    p.add_argument("--batches", type=ints, default=[1, 4, 16, 32])
    p.add_argument("--blocks", type=ints, default=[1, 11])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: the runner's)")
    p.add_argument("--cache", default=None, help="ONNX export cache (default: a fresh temporary directory)")
    return p.parse_args(argv)


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
