"""`specdec bench`: every decoding mode on the UA-GEC test split (`evaluation.benchmark`); prints the
table and, with --write, replaces its BENCHMARKS.md section."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.backends import BACKENDS
from core.config import DEVICE_HELP, device_arg
from evaluation import benchmark
from specdec.api import resolve_bundle


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark every decoding mode on the UA-GEC test split (BENCHMARKS.md)")
    p.add_argument("--bundle", help="model bundle directory (default: $SPECDEC_BUNDLE or bundles/ua-gec)")
    p.add_argument("--sample", type=int, help=f"first N test sentences in corpus order (default "
                   f"{benchmark.DEFAULT_SAMPLE}; {benchmark.QUICK_SAMPLE} with --quick; 0 = all)")
    p.add_argument("--through", choices=list(benchmark.STACKS), default="in-process", help="which stack decodes")
    p.add_argument("--backend", choices=BACKENDS,
                   help="verifier and NAR drafter backend (default: onnxruntime)")
    p.add_argument("--device", type=device_arg, default="auto",
                   help=f"where the models run, in-process and in the services alike: {DEVICE_HELP}")
    p.add_argument("--max-new-tokens", type=int, help=f"output limit (default {benchmark.DEFAULT_MAX_NEW_TOKENS}; "
                   f"{benchmark.QUICK_MAX_NEW_TOKENS} with --quick)")
    p.add_argument("--threads", type=int, help="torch intra-op threads, in-process and in the services "
                   "(OMP_NUM_THREADS); default: torch's own choice")
    p.add_argument("--quick", action="store_true", help="one configuration per mode, a small sample")
    p.add_argument("--data-dir", help="prepared training data dir whose test.text.jsonl to use (default: ua-gec)")
    p.add_argument("--write", action="store_true", help=f"replace the '{benchmark.SECTION}' section of --output")
    p.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"), help="default: ./BENCHMARKS.md")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark for the parsed flags; 1 when a lossless mode lost."""
    from core.backends import DEFAULT_BACKEND
    from training.data import load_test_set

    bundle_dir = resolve_bundle(args.bundle)
    command = " ".join(["specdec bench", *sys.argv[2:]])
    backend = args.backend or DEFAULT_BACKEND
    quick = args.quick
    sample = args.sample if args.sample is not None else benchmark.QUICK_SAMPLE if quick else benchmark.DEFAULT_SAMPLE
    max_new = args.max_new_tokens or (benchmark.QUICK_MAX_NEW_TOKENS if quick else benchmark.DEFAULT_MAX_NEW_TOKENS)
    try:
        items = load_test_set(args.data_dir)
    except ModuleNotFoundError as exc:
        raise ValueError(f"the UA-GEC test split needs the ua-gec package (pip install -e '.[train]') or "
                         f"--data-dir with a prepared test.text.jsonl ({exc})") from None
    configs = benchmark.quick_configs() if quick else benchmark.full_configs()
    result = benchmark.run_benchmark(bundle_dir, items, configs, benchmark.STACKS[args.through], backend, max_new,
                                     progress=lambda line: print(line, file=sys.stderr, flush=True),
                                     limit=sample or None, threads=args.threads, device=args.device)
    print(benchmark.format_table(result))
    for note in result.notes:
        print(note, file=sys.stderr if note.startswith("LOSSLESS") else sys.stdout)
    if args.write:
        benchmark.write_report(args.output, result, backend, command)
    return 0 if result.lossless_ok else 1
