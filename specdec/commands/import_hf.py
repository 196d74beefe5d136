"""`specdec import-hf`: a Hugging Face seq2seq checkpoint (and optionally a smaller one of the same
vocabulary as its AR drafter) written as a bundle every other command takes
(`seq2seq_models.hf_import`).

Importing needs `transformers` (the `hf` extra); serving the bundle it writes does not.
"""

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
    p.add_argument("--force", action="store_true", help="replace --out whole when it is not empty (without it, "
                   "--out must be new or empty)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        from seq2seq_models.hf_import.write_bundle import write_bundle
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ValueError(f"import-hf needs transformers and torch: pip install -e '.[hf]' ({exc})") from None
    drafter = Path(args.ar_drafter) if args.ar_drafter else None
    out = write_bundle(Path(args.model), Path(args.out), drafter, args.name, force=args.force,
                       report=lambda line: print(line, file=sys.stderr))
    print(f"wrote {out}", file=sys.stderr)
    return 0
