"""How a verify step's cost grows with its block size, for verifiers of several sizes (ONNX Runtime, CPU).

    python bench/bench_block_cost.py            # print the table
    python bench/bench_block_cost.py --write    # also update its section of BENCHMARKS.md

Draft-verify decoding wins when scoring a block of b tokens costs little more than scoring one: the
speed-up is at most (tokens accepted per iteration) x cost(1) / cost(b), even with a free drafter.
This measures cost(b) / cost(1) on this machine for the bundled verifier's shape and for the larger
shapes of the issue's sizing guide, with random weights (the cost does not depend on them). A step
of block b is `step(committed_len=P-1, append_ids=[x], draft_ids=b-1 tokens)` after a cached
prefix of P=20 tokens and a 30-token source, as GAD sends it; "encoder" is `open()` on that source.
Median of `--repeats` calls per block.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import cpu_name, median_seconds, write_section
from seq2seq_models.config import ModelConfig
from seq2seq_models.transformer import Seq2SeqTransformer
from verifier_service.onnx_backend import OnnxVerifier

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Verify-step cost by block size (CPU)"
SHAPES = {
    "4+3, d256 (the bundled verifier's shape)": dict(d_model=256, n_heads=4, encoder_layers=4, decoder_layers=3,
                                                     ffn_dim=1024),
    "6+6, d512": dict(d_model=512, n_heads=8, encoder_layers=6, decoder_layers=6, ffn_dim=2048),
    "6+6, d768": dict(d_model=768, n_heads=12, encoder_layers=6, decoder_layers=6, ffn_dim=3072),
}
PREFIX, SOURCE_LEN, VOCAB = 20, 30, 8000


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    torch.manual_seed(0)
    rows = [(name, *_measure(shape, args)) for name, shape in SHAPES.items()]
    table = _table(rows, args.blocks)
    print(table)
    if args.write:
        command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_block_cost.py", *(argv or sys.argv[1:])])
        stamp = (f"Machine: {cpu_name()}, {os.cpu_count()} cores; ONNX Runtime CPU provider; "
                 f"date {dt.date.today().isoformat()}; command `{command}`")
        note = (f"Random weights, vocabulary {VOCAB}, batch 1; a step of block b appends one token and b-1 draft "
                f"tokens after a cached prefix of {PREFIX}; encoder = opening a session on a {SOURCE_LEN}-token "
                f"source. Median of {args.repeats} calls. x = cost relative to block 1.")
        write_section(args.output, SECTION, f"{stamp}\n\n{note}\n\n{table}")
    return 0


def _measure(shape: dict, args: argparse.Namespace) -> tuple[float, float, dict[int, float]]:
    """Parameters (millions), encoder ms, and the median step ms per block size."""
    model = Seq2SeqTransformer(ModelConfig(vocab_size=VOCAB, max_len=256, dropout=0.0, **shape)).eval()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    gen = torch.Generator().manual_seed(0)
    source = torch.randint(5, VOCAB, (SOURCE_LEN,), generator=gen).tolist()
    prefix = torch.randint(5, VOCAB, (PREFIX,), generator=gen).tolist()
    pool = torch.randint(5, VOCAB, (max(args.blocks),), generator=gen).tolist()
    with tempfile.TemporaryDirectory() as cache:
        verifier = OnnxVerifier(model, cache_root=cache)
        encoder_ms = _median_ms(lambda: verifier.open(source), args.repeats)
        costs = {}
        for block in args.blocks:
            session = verifier.open(source)
            session.step(0, prefix, [], 1)
            costs[block] = _median_ms(lambda s=session, b=block: s.step(PREFIX - 1, [prefix[-1]], pool[: b - 1], 1),
                                      args.repeats)
    return params, encoder_ms, costs


def _median_ms(call, repeats: int) -> float:
    return median_seconds(call, repeats, warmup=10) * 1e3


def _table(rows, blocks: list[int]) -> str:
    head = ["verifier", "params", "encoder ms", *(f"block {b} ms" for b in blocks)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, params, encoder_ms, costs in rows:
        first = costs[blocks[0]]
        cells = [name, f"{params:.1f}M", f"{encoder_ms:.2f}",
                 *(f"{costs[b]:.2f} ({costs[b] / first:.2f}x)" for b in blocks)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 5, 11, 32])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--write", action="store_true", help="update the section in BENCHMARKS.md")
    p.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md", help="file --write updates")
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
