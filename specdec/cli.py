"""The `specdec` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from core.errors import BindError, SpecdecError
from specdec.commands import (
    bench,
    decode,
    distill,
    export,
    generate,
    health,
    import_hf,
    loadtest,
    serve,
    tiny_bundle,
    train,
)

# Every subcommand's module (specdec/commands/), in the order `specdec --help` lists them; each one's
# `register(sub)` adds its parser(s) and the function that runs the command.
COMMANDS = (import_hf, distill, tiny_bundle, decode, export, serve, health, generate, loadtest, train, bench)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except SpecdecError as exc:
        print(f"specdec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (BindError, FileNotFoundError, KeyError, ValueError) as exc:
        print(f"specdec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    from specdec import __version__

    parser = _Parser(prog="specdec", description=__doc__)
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option that takes a value ends its help with its default ("none": unset), unless the
    help already says it; flags (off unless given) and required options are left as they are."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.nargs == 0 or action.required:
            return text
        if action.default is argparse.SUPPRESS:
            return text
        shown = "none" if action.default is None else "%(default)s"
        return f"{text} (default: {shown})".lstrip()


if __name__ == "__main__":
    sys.exit(main())
