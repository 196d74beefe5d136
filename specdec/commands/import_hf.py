"""`specdec import-hf`: its flags, and the import (`specdec.import_hf.import_hf`) they describe."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "import-hf",
        help="write a bundle from a Hugging Face save_pretrained directory (Marian, BART, mBART, T5/mT5, M2M100/NLLB)",
    )
    p.add_argument("--model", required=True, help="the verifier's save_pretrained directory")
    p.add_argument("--out", required=True, help="the bundle directory to write")
    p.add_argument("--ar-drafter", help="a smaller checkpoint of the same vocabulary: the bundle's AR drafter")
    p.add_argument("--name", help="the bundle's name (default: the model directory's name)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specdec.import_hf import import_hf

    out = import_hf(Path(args.model), Path(args.out), Path(args.ar_drafter) if args.ar_drafter else None, args.name)
    print(f"wrote {out}", file=sys.stderr)
    return 0
