"""Time the fused output head against the unfused torch path.

    python bench/bench_head.py            # print the table
    python bench/bench_head.py --write    # also update the "Fused output head" section(s) of BENCHMARKS.md

Unfused = what a model would do without the head: F.linear + log_softmax + topk + gather. Fused =
`kernels.output_head_cpu` (and, on CUDA, `kernels.output_head_triton`). The "fused epilogue only"
column runs the CPU path's epilogue after F.linear's GEMM, to show how much of the win is the GEMM.
Calls of the paths are interleaved and the median of many is reported, so that a noisy neighbour on
a shared machine skews both sides alike.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation.bench_report import cpu_name, write_section
from kernels.cpu import _gather_targets, output_head_cpu, topk_lowest_id_first
from kernels.triton_head import output_head_triton, triton_available

REPO = Path(__file__).resolve().parents[1]
CPU_SECTION = "## Fused output head (CPU)"
CUDA_SECTION = "## Fused output head (Triton, CUDA)"


@dataclass
class Row:
    vocab: int
    dim: int
    rows: int
    times_ms: dict[str, float]


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = [(vocab, dim, rows) for vocab in args.vocab for dim in args.dim for rows in args.rows]
    cpu_rows = _bench(shapes, "cpu", args)
    cpu_table = _table(cpu_rows, [("unfused", "unfused (ms)"), ("epilogue", "fused epilogue only (ms)"),
                                  ("fused", "fused CPU (ms)")])  # fmt: skip
    print(f"\n{CPU_SECTION}\n\n{_machine_line()}\n\n{cpu_table}")

    cuda_text = None
    if torch.cuda.is_available() and triton_available():
        peak = _copy_bandwidth_gbs()
        cuda_rows = _bench(shapes, "cuda", args)
        cuda_table = _table(cuda_rows, [("unfused", "unfused (ms)"), ("fused", "Triton (ms)")], peak_gbs=peak)
        cuda_text = f"{_cuda_line(peak)}\n\n{cuda_table}"
        print(f"\n{CUDA_SECTION}\n\n{cuda_text}")

    if args.write:
        command = "python bench/bench_head.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        stamp = f"{_machine_line()}  \nDate: {dt.date.today().isoformat()}  \nCommand: `{command.strip()}`"
        write_section(args.output, CPU_SECTION, f"{stamp}\n\n{_method_note(args)}\n\n{cpu_table}")
        if cuda_text is not None:
            write_section(args.output, CUDA_SECTION, f"{stamp}\n\n{cuda_text}")
        print(f"\nwrote {args.output}")
    return 0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="update the section(s) in BENCHMARKS.md")
    p.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md", help="file --write updates")
    p.add_argument("--vocab", type=int, nargs="+", default=[8192, 32000])
    p.add_argument("--dim", type=int, nargs="+", default=[256, 512])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5, 10, 25])
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--repeats", type=int, default=200, help="timed calls per path and shape")
    p.add_argument("--rounds", type=int, default=5, help="passes over all shapes the calls are spread over")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    return p.parse_args(argv)


# --- the paths timed -----------------------------------------------------------------------------


def unfused_head(hidden: Tensor, weight: Tensor, bias: Tensor, k: int, targets: Tensor) -> tuple[Tensor, ...]:
    logprobs = F.log_softmax(F.linear(hidden, weight, bias), dim=-1)
    top = logprobs.topk(k, dim=-1)
    target_lp = logprobs.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    return top.values, top.indices, target_lp


def fused_epilogue_only(
    hidden: Tensor, weight: Tensor, bias: Tensor, k: int, targets: Tensor
) -> tuple[Tensor, ...]:
    # The CPU path with its oneDNN GEMM swapped back for F.linear (MKL).
    logprobs = F.linear(hidden, weight, bias)
    torch._log_softmax(logprobs, 1, False, out=logprobs)
    return (*topk_lowest_id_first(logprobs, k), _gather_targets(logprobs, targets))


def _weights(vocab: int, dim: int, device: str) -> tuple[Tensor, Tensor]:
    # Logits of a few units, like a trained head's (and no denormal-heavy exp tails).
    weight = torch.randn(vocab, dim, device=device) * (2.0 / dim**0.5)
    bias = torch.randn(vocab, device=device) * 0.5
    return weight, bias


# --- timing --------------------------------------------------------------------------------------


def _bench(shapes: list[tuple[int, int, int]], device: str, args: argparse.Namespace) -> list[Row]:
    """Median ms per path and shape. The timed calls of every shape are spread over `rounds` passes
    across all shapes, and the paths' calls are interleaved, so that a slow spell of a shared machine
    (other processes, a noisy neighbour VM) lands on all paths and shapes alike rather than on one.
    """
    sync = torch.cuda.synchronize if device == "cuda" else None
    weights: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
    all_paths = []
    for vocab, dim, rows in shapes:
        if (vocab, dim) not in weights:
            weights[vocab, dim] = _weights(vocab, dim, device)
        all_paths.append(_paths(*weights[vocab, dim], rows, args.k, device))
    for paths in all_paths:
        _time_interleaved(paths, args.warmup, sync)
    samples: list[dict[str, list[float]]] = [{name: [] for name in paths} for paths in all_paths]
    per_round = max(1, args.repeats // args.rounds)
    for _ in range(args.rounds):
        for paths, shape_samples in zip(all_paths, samples, strict=True):
            _time_interleaved(paths, 2, sync)  # untimed: the other shapes have evicted this W
            for name, times in _time_interleaved(paths, per_round, sync).items():
                shape_samples[name] += times
    return [
        Row(vocab, dim, rows, {name: statistics.median(times) for name, times in shape_samples.items()})
        for (vocab, dim, rows), shape_samples in zip(shapes, samples, strict=True)
    ]


def _paths(weight: Tensor, bias: Tensor, rows: int, k: int, device: str) -> dict[str, Callable[[], object]]:
    hidden = torch.randn(rows, weight.shape[1], device=device)
    targets = torch.randint(0, weight.shape[0], (rows,), device=device)
    targets[::3] = -1
    unfused = {"unfused": lambda: unfused_head(hidden, weight, bias, k, targets)}
    if device == "cuda":
        return {**unfused, "fused": lambda: output_head_triton(hidden, weight, bias, k, targets)}
    return {
        **unfused,
        "epilogue": lambda: fused_epilogue_only(hidden, weight, bias, k, targets),
        "fused": lambda: output_head_cpu(hidden, weight, bias, k, targets),
    }


def _time_interleaved(
    paths: dict[str, Callable[[], object]], calls: int, sync: Callable[[], None] | None
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for i in range(calls):
        # Alternate the order so neither path always runs right after the other (cache state).
        for name in names if i % 2 == 0 else reversed(names):
            if sync is not None:
                sync()
            start = time.perf_counter()
            paths[name]()
            if sync is not None:
                sync()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return samples


def _copy_bandwidth_gbs() -> float:
    """Peak device memory bandwidth, measured as a large device-to-device copy (read + write)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    return 2 * src.numel() * src.element_size() / seconds / 1e9


# --- reporting -----------------------------------------------------------------------------------


def _table(rows: list[Row], columns: list[tuple[str, str]], peak_gbs: float | None = None) -> str:
    head = ["vocab", "D", "rows", *(title for _, title in columns), "speed-up"]
    if peak_gbs is not None:
        head += ["W read (GB/s)", "% of copy peak"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [str(r.vocab), str(r.dim), str(r.rows), *(f"{r.times_ms[key]:.3f}" for key, _ in columns)]
        cells.append(f"{r.times_ms['unfused'] / r.times_ms['fused']:.2f}x")
        if peak_gbs is not None:
            gbs = r.vocab * r.dim * 4 / (r.times_ms["fused"] / 1e3) / 1e9
            cells += [f"{gbs:.0f}", f"{100 * gbs / peak_gbs:.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _method_note(args: argparse.Namespace) -> str:
    return (
        f"fp32, k={args.k}, median of {args.repeats} interleaved calls (spread over {args.rounds} passes "
        f"over all shapes) after {args.warmup} warm-up calls; "
        "speed-up = unfused / fused CPU. Unfused: F.linear + log_softmax + topk + gather. Fused CPU: "
        "`kernels.output_head_cpu` (oneDNN GEMM with fused bias, in-place log-softmax, one topk with the "
        "tie-order fix, gather). Fused epilogue only: the same epilogue after F.linear's (MKL) GEMM."
    )


def _machine_line() -> str:
    return f"Machine: {cpu_name()}, {torch.get_num_threads()} torch threads; torch {torch.__version__}"


def _cuda_line(peak_gbs: float) -> str:
    name = torch.cuda.get_device_name()
    return (
        f"Device: {name}; measured copy peak {peak_gbs:.0f} GB/s (1 GiB device-to-device copy, read + write)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
