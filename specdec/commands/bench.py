"""`specdec bench`: every decoding mode on the UA-GEC test split (`specdec.benchmark`)."""

from __future__ import annotations

import argparse
import sys

from specdec.api import resolve_bundle


def register(sub) -> None:
    from specdec.benchmark import add_arguments

    p = sub.add_parser("bench", help="benchmark every decoding mode on the UA-GEC test split (BENCHMARKS.md)")
    add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specdec.benchmark import run_from_args

    return run_from_args(args, resolve_bundle(args.bundle), " ".join(["specdec bench", *sys.argv[2:]]))
