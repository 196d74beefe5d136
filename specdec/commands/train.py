"""`specdec train` and `specdec evaluate`: the training pipeline (`training.pipeline`) and the text
quality of a run's verifier (`evaluation.run_quality`). Registered only where `training/` is
importable: it ships with the source tree, not necessarily with an installed wheel."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path


def register(sub) -> None:
    try:
        from training.arguments import PRESET_NAMES
        from training.arguments import add_arguments as add_train_arguments
    except ModuleNotFoundError:
        return
    p = sub.add_parser("train", help="train the bundled UA-GEC models (all stages; resumable)")
    add_train_arguments(p)
    p.set_defaults(run=run_train)

    p = sub.add_parser("evaluate", help="GLEU of a training run's verifier on the validation split, "
                                        "beside the sources'")
    p.add_argument("--out", required=True, type=Path, help="run directory (its data and tokenizer stages done)")
    p.add_argument("--preset", choices=PRESET_NAMES, default="full", help="the run's preset")
    p.add_argument("--weights", help="weights to score, relative to --out or absolute: a state dict "
                   "(best.pt, snapshots/step-N.pt) or a training checkpoint (checkpoint.pt, mid-run); "
                   "default verifier/best.pt")
    p.add_argument("--groups", type=int, default=500, help="validation sentences (with all references)")
    p.add_argument("--beams", type=int, default=1, help="1 = greedy")
    p.add_argument("--threads", type=int, help="torch threads (default: the CPUs this process may use)")
    p.set_defaults(run=run_evaluate)


def run_train(args: argparse.Namespace) -> int:
    from training.pipeline import run_from_args

    return run_from_args(args, " ".join(["specdec train", *sys.argv[2:]]))


def run_evaluate(args: argparse.Namespace) -> int:
    """One JSON object: GLEU of --groups validation sentences, spread over the split, decoded by the run's verifier."""
    if args.groups < 1 or args.beams < 1:
        print("error: --groups and --beams must be at least 1", file=sys.stderr)
        return 2
    from evaluation.run_quality import RunError, evaluate_quality, load_run_verifier, spread, validation_groups
    from training.pipeline import configure_threads

    configure_threads(args.threads)
    try:
        model, tokenizer, weights = load_run_verifier(args.out, args.preset, args.weights)
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    items = spread(validation_groups(args.out / "data" / "valid.text.jsonl"), args.groups)
    report = evaluate_quality(model.eval(), tokenizer, items, beams=args.beams, weights=str(weights))
    print(json.dumps(asdict(report), ensure_ascii=False))
    return 0
