"""`specdec tiny-bundle`: a deterministic random bundle for tests and demos."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("tiny-bundle", help="write a deterministic random bundle for tests and demos")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from seq2seq_models.bundle import make_tiny_bundle

    out = make_tiny_bundle(args.out, args.seed)
    print(out)
    return 0
