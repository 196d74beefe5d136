"""End-to-end GAD (and IAD) speed-up over greedy with each model backend (verifier and NAR drafter
both on it), on the trained bundle.

    python bench/bench_gad_backends.py            # print the table
    python bench/bench_gad_backends.py --write    # also update its section of BENCHMARKS.md

Each backend decodes the same UA-GEC test sentences in its own process (torch's OpenMP pool and
ORT's both spin while waiting, so two live backends in one process slow each other down), with
`evaluation.benchmark.run_benchmark` in-process: greedy, IAD and GAD rows of one run, so every ratio
is measured under the same conditions.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from evaluation import benchmark
from evaluation.bench_report import cpu_name, write_section
from specdec.api import resolve_bundle

REPO = Path(__file__).resolve().parents[1]
SECTION = "## End-to-end speed-up per model backend"
BACKENDS = ("torch", "onnxruntime")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    configs = _configs(args.k)
    if args.child:
        print(json.dumps(_measure(args, args.child, configs)))
        return 0
    rows = {}
    for backend in BACKENDS:
        cmd = [sys.executable, __file__, "--child", backend, *(argv if argv is not None else sys.argv[1:])]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows[backend] = json.loads(out.strip().splitlines()[-1])
    table = _table(rows, [c.name for c in configs])
    print(table)
    if args.write:
        command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_gad_backends.py", *(argv or sys.argv[1:])])
        import torch

        threads = args.threads or torch.get_num_threads()
        stamp = (f"Machine: {cpu_name()}, {os.cpu_count()} cores, {threads} torch threads; "
                 f"date {dt.date.today().isoformat()}; command `{command}`")
        note = (f"Bundle `{rows[BACKENDS[0]]['bundle']}`; the first {args.sample} UA-GEC test sentences, batch 1, "
                "in-process (`decode()` with the verifier and the NAR drafter on the backend), one timed pass per "
                f"row after a warm-up, the rows interleaved in {benchmark.ROUNDS} rounds as in `specdec bench`. "
                "ms = mean wall time per sentence.")
        write_section(args.output, SECTION, f"{stamp}\n\n{note}\n\n{table}")
    return 0


def _configs(k: int) -> list[benchmark.BenchConfig]:
    wanted = {benchmark.GREEDY, f"IAD k={benchmark.IAD_CAP}", f"GAD k={k}"}
    return [c for c in benchmark.full_configs() if c.name in wanted]


def _measure(args: argparse.Namespace, backend: str, configs) -> dict:
    from training.data import load_test_set

    result = benchmark.run_benchmark(resolve_bundle(args.bundle), load_test_set(), configs, backend=backend,
                                     limit=args.sample, threads=args.threads)
    if not result.lossless_ok:
        raise SystemExit("\n".join(result.notes))
    return {"bundle": result.bundle_name, "rows": {r.name: {"ms": r.ms_per_sentence} for r in result.rows}}


def _table(rows: dict[str, dict], names: list[str]) -> str:
    greedy = benchmark.GREEDY
    others = [n for n in names if n != greedy]
    head = ["backend", f"{greedy} ms", *(f"{n} ms" for n in others), *(f"{n} speed-up" for n in others)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for backend, data in rows.items():
        r = data["rows"]
        cells = [backend, f"{r[greedy]['ms']:.1f}", *(f"{r[n]['ms']:.1f}" for n in others),
                 *(f"{r[greedy]['ms'] / r[n]['ms']:.2f}x" for n in others)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", help="model bundle directory (default: $SPECDEC_BUNDLE or bundles/ua-gec)")
    p.add_argument("--sample", type=int, default=500, help="first N test sentences")
    p.add_argument("--k", type=int, default=10, help="GAD block size")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--write", action="store_true", help="update the section in BENCHMARKS.md")
    p.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md", help="file --write updates")
    p.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
