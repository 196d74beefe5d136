"""`specdec train` and `specdec evaluate`: the training pipeline (`training.pipeline`) and the text
quality of a run's verifier (`specdec.run_quality`). Registered only where `training/` is importable:
it ships with the source tree, not necessarily with an installed wheel."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    try:
        from training.arguments import add_arguments as add_train_arguments
    except ModuleNotFoundError:
        return
    p = sub.add_parser("train", help="train the bundled UA-GEC models (all stages; resumable)")
    add_train_arguments(p)
    p.set_defaults(run=run_train)

    from specdec.run_quality import add_arguments as add_evaluate_arguments

    p = sub.add_parser("evaluate", help="GLEU of a training run's verifier on the validation split, "
                                        "beside the sources'")
    add_evaluate_arguments(p)
    p.set_defaults(run=run_evaluate)


def run_train(args: argparse.Namespace) -> int:
    from training.pipeline import run_from_args

    return run_from_args(args, " ".join(["specdec train", *sys.argv[2:]]))


def run_evaluate(args: argparse.Namespace) -> int:
    from specdec.run_quality import run_from_args

    return run_from_args(args)
