"""`specdec decode`: stdin's lines decoded in-process, one JSON object a line."""

from __future__ import annotations

import argparse
import json
import sys

from core.backends import BACKENDS, PRECISIONS
from core.config import DEVICE_HELP, device_arg
from core.errors import SpecdecError
from specdec.commands import flags


def register(sub) -> None:
    p = sub.add_parser("decode", help="decode stdin lines in-process, one JSON object per line")
    p.add_argument("--bundle", help=flags.BUNDLE_HELP)
    p.add_argument("--ids", action="store_true", help="lines are space-separated token ids, not text")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="the models' dtype (torch)")
    p.add_argument("--backend", choices=BACKENDS, default=None, help=flags.BACKEND_HELP)
    p.add_argument("--precision", choices=PRECISIONS, default=None, help=flags.PRECISION_HELP)
    p.add_argument("--device", type=device_arg, default="auto", help=f"where the models run: {DEVICE_HELP}")
    p.add_argument("--target-lang", default="", metavar="CODE", help=flags.TARGET_LANG_HELP)
    flags.add_decoding_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """`Engine.load` and `Engine.generate_each` over stdin's lines: one JSON record a line, in order;
    a bad line gets an error record and the rest go on (exit status 2 if any failed)."""
    from decoding.request import Policy
    from specdec.api import Engine

    engine = Engine.load(args.bundle, backend=args.backend, precision=args.precision, device=args.device,
                         dtype=args.dtype, policy=Policy(flags=True))
    overrides = {k: v for k, v in flags.decoding_overrides(args).items() if v is not None}
    engine.prepare_config(overrides)  # a bad flag is one error for the run, before any line is read
    requests = (_line_request(engine, number, line.rstrip("\n"), args, overrides)
                for number, line in enumerate(sys.stdin, start=1))
    failed = 0
    for index, outcome in engine.generate_each(requests):
        if isinstance(outcome, SpecdecError):
            failed += 1
            print(f"specdec decode: error: {outcome.code.value}: line {index + 1}: {outcome.message}", file=sys.stderr)
            record = {"line": index + 1, "error": outcome.message, "code": outcome.code.value}
        else:
            record = {"output_ids": outcome.output_ids, "text": outcome.text, "stats": outcome.stats.record()}
        print(json.dumps(record, ensure_ascii=False), flush=True)
    return 2 if failed else 0


def _line_request(engine, number: int, line: str, args: argparse.Namespace, overrides: dict):
    """One stdin line as a request (text, or ids with --ids), or the SpecdecError of a malformed one."""
    try:
        ids = _parse_ids(line) if args.ids and line.strip() else None
    except SpecdecError as exc:
        return exc
    if ids is not None:
        return engine.request(ids, args.target_lang, overrides)
    return engine.request(line if line.strip() else [], args.target_lang, overrides)


def _parse_ids(line: str) -> list[int]:
    from core.errors import invalid

    try:
        return [int(tok) for tok in line.split()]
    except ValueError:
        raise invalid(f"--ids expects space-separated integers, got {line[:40]!r}") from None
