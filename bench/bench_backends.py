"""Time one verify step on the torch eager backend against ONNX Runtime (CPU).

    python bench/bench_backends.py            # print the table
    python bench/bench_backends.py --write    # also update "## Verifier backends (CPU)" in BENCHMARKS.md

A verify step of block size b is `step(committed_len=P-1, append_ids=[x], draft_ids=b-1 tokens)`
against a cached prefix of P tokens: what GAD sends (the correction plus the draft), i.e. one
forward of b tokens plus the output head on those b rows. Every timed call rolls the session back
to the same prefix, so each repeat does the same work. The verifier is sized like the planned
trained one, with random weights (timing does not depend on them). Calls of the backends are
interleaved and the median of many is reported, so a noisy neighbour skews all sides alike.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import cpu_name, write_section
from seq2seq_models.config import ModelConfig
from seq2seq_models.transformer import Seq2SeqTransformer
from verifier_service.onnx_backend import OnnxVerifier
from verifier_service.session import LocalVerifier

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Verifier backends (CPU)"
BACKENDS = ("torch (reference head)", "torch (kernels.output_head)", "onnxruntime")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args, args.child)))
        return 0
    # Each backend runs in its own process: torch's OpenMP workers and ORT's pool both wait for
    # work by spinning, so two backends in one process on 2 cores slow each other down (measured:
    # torch steps 5-10x slower next to a live ORT session). Rounds alternate the order, and the
    # median over all rounds is reported, so a noisy neighbour skews all backends alike.
    samples: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.blocks} for name in BACKENDS}
    with tempfile.TemporaryDirectory() as cache:
        for r in range(args.rounds):
            for name in BACKENDS if r % 2 == 0 else reversed(BACKENDS):
                cmd = [sys.executable, __file__, "--child", name, "--onnx-cache", cache, *(argv or sys.argv[1:])]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                for block, ts in json.loads(out.strip().splitlines()[-1]).items():
                    samples[name][int(block)].extend(ts)
    rows = [(b, {n: statistics.median(samples[n][b]) for n in BACKENDS}) for b in args.blocks]
    table = _table(rows, list(BACKENDS))
    print(table)
    if args.write:
        command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_backends.py", *(argv or sys.argv[1:])])
        stamp = f"{_machine_line(args)}; date {dt.date.today().isoformat()}; command `{command}`"
        write_section(args.output, SECTION, f"{stamp}\n\n{_method_note(args)}\n\n{table}")
    return 0


def _measure(args: argparse.Namespace, backend: str) -> dict[int, list[float]]:
    """Per block size, the times (ms) of `repeats // rounds` steps on one backend."""
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    model = Seq2SeqTransformer(_config(args)).eval()
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    source = torch.randint(5, vocab, (args.prefix,), generator=gen).tolist()
    prefix = torch.randint(5, vocab, (args.prefix,), generator=gen).tolist()
    draft_pool = torch.randint(5, vocab, (max(args.blocks),), generator=gen).tolist()
    if backend == "onnxruntime":
        verifier = OnnxVerifier(model, cache_root=args.onnx_cache, device="cpu", intra_op_threads=args.threads)
    else:
        from kernels import output_head, output_head_reference

        fast = backend == "torch (kernels.output_head)"
        verifier = LocalVerifier(model, head=output_head if fast else output_head_reference)
    session = verifier.open(source)
    session.step(0, prefix, [], top_k=args.top_k)
    result = {}
    for block in args.blocks:
        draft = draft_pool[: block - 1]
        for _ in range(args.warmup):
            session.step(args.prefix - 1, [prefix[-1]], draft, args.top_k)
        times = []
        for _ in range(max(1, args.repeats // args.rounds)):
            start = time.perf_counter()
            session.step(args.prefix - 1, [prefix[-1]], draft, args.top_k)
            times.append((time.perf_counter() - start) * 1e3)
        result[block] = times
    return result


def _config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab, d_model=args.d_model, n_heads=args.heads, encoder_layers=args.layers,
        decoder_layers=args.layers, ffn_dim=args.ffn, max_len=256, dropout=0.0,
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="update the section in BENCHMARKS.md")
    p.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md", help="file --write updates")
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 5, 10, 25])
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--prefix", type=int, default=30, help="cached output tokens before the block")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: cores)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=4, help="processes per backend, alternating order")
    p.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--onnx-cache", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _table(rows: list[tuple[int, dict[str, float]]], names: list[str]) -> str:
    base, best_torch = names[0], names[1]
    head = ["block", *(f"{n} ms" for n in names), "speed-up vs torch (ref head)", "speed-up vs torch (fast head)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for block, times in rows:
        cells = [str(block), *(f"{times[n]:.3f}" for n in names)]
        cells.append(f"{times[base] / times['onnxruntime']:.2f}x")
        cells.append(f"{times[best_torch] / times['onnxruntime']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _method_note(args: argparse.Namespace) -> str:
    cfg = _config(args)
    return (
        f"Verifier: vocab {cfg.vocab_size}, d_model {cfg.d_model}, {cfg.n_heads} heads, "
        f"{cfg.encoder_layers}+{cfg.decoder_layers} layers, ffn {cfg.ffn_dim}, fp32, random weights; batch 1, "
        f"prefix of {args.prefix} cached tokens, top_k={args.top_k}. One step = `VerifierSession.step` end to "
        "end (Python bookkeeping included) with a block of b tokens (1 appended + b-1 drafted), rolled back to "
        f"the same prefix every call; median of {args.repeats} calls per backend, spread over {args.rounds} "
        f"processes per backend (alternating order; {args.warmup} warm-up calls each). "
        "torch: eager `LocalVerifier` with the sort-based reference head, and with the fast "
        "`kernels.output_head` (its default). onnxruntime: `OnnxVerifier` (CPU EP, encoder + decoder-with-past graphs, "
        "head fused into the decoder graph)."
    )


def _machine_line(args: argparse.Namespace) -> str:
    import onnxruntime as ort

    return (
        f"Machine: {cpu_name()}, {args.torch_threads or torch.get_num_threads()} torch threads, ORT intra-op threads "
        f"{args.threads or 'default'}; torch {torch.__version__}, onnxruntime {ort.__version__}"
    )


if __name__ == "__main__":
    sys.exit(main())
