"""`specdec generate`: one text decoded through a running gateway (`specdec.client`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdec.commands import flags


def register(sub) -> None:
    p = sub.add_parser("generate", help="decode one text through a running gateway")
    p.add_argument("text", nargs="?", help="the text; without it (or with -), the text is read from stdin")
    p.add_argument("--file", metavar="PATH", help="read the text from this file (UTF-8)")
    p.add_argument("--addr", type=flags.address_arg, default=flags.default_addr(), help=flags.ADDR_HELP)
    p.add_argument("--json", action="store_true", help="print the same JSON object as `specdec decode`")
    flags.add_target_flags(p)
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    flags.add_client_security(p)
    flags.add_decoding_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specdec.client import CallError, degraded_note, format_record, generate

    tls, token = flags.client_security(args)
    text = _generate_text(args)
    try:
        record = generate(args.addr, text, flags.decoding_overrides(args), timeout=args.timeout, tls=tls, token=token,
                          target_lang=args.target_lang, target_prefix=flags.target_prefix(args))
    except CallError as exc:  # e.g. a missing token: one line, like specdec's own errors, not a traceback
        print(f"specdec generate: error: {exc}", file=sys.stderr)
        return 2
    print(format_record(record, args.json), flush=True)
    note = None if args.json else degraded_note(record)
    if note is not None:
        print(f"specdec generate: {note}", file=sys.stderr)
    return 0


def _generate_text(args: argparse.Namespace) -> str:
    """The text of `generate`: the argument, --file, or stdin (no argument, or "-"); one trailing
    newline of a file or stdin is not part of it."""
    if args.text is not None and args.text != "-" and args.file is not None:
        raise ValueError("give the text as an argument or with --file, not both")
    if args.file is not None:
        text = Path(args.file).read_text(encoding="utf-8")
    elif args.text is not None and args.text != "-":
        return args.text
    else:
        if sys.stdin.isatty():
            print("specdec generate: reading the text from stdin (end it with Ctrl-D)", file=sys.stderr)
        text = sys.stdin.read()
    return text.removesuffix("\n").removesuffix("\r")
