"""`specdec decode`: lines of text (or ids) decoded in-process, one JSON object a line.

Inputs come from `--input FILE` or stdin, records go to `--output FILE` or stdout. `--batch-size N`
keeps N lines decoding at once through one continuous-batching engine (`Engine.bulk`: the
services' scheduler, in process), admitted by length; records come out in input order, or with
`--unordered` as they finish (then each carries its `line`). A progress line goes to stderr: a bar
on a terminal, a line every few seconds otherwise. Ctrl-C writes what has finished and exits 130."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, TextIO

from core.backends import BACKENDS, PRECISIONS
from core.config import DEVICE_HELP, device_arg
from core.errors import SpecdecError
from specdec.commands import flags
from specdec.progress import Progress, progress

# Lines decoding at once by default: enough rows to fill a CPU forward (BENCHMARKS.md, "Bulk decoding").
DEFAULT_BATCH_SIZE = 32
# `--workers auto` on a CPU: a worker per usable CPU (two one-thread workers beat one of two threads in
# every mode of BENCHMARKS.md, "Bulk decoding"), each keeping at least this many of the batch's lines,
# since a forward of few rows pays its fixed cost for little.
ROWS_PER_WORKER = 16


def register(sub) -> None:
    p = sub.add_parser("decode", help="decode stdin lines in-process, one JSON object per line")
    p.add_argument("--bundle", help=flags.BUNDLE_HELP)
    p.add_argument("--ids", action="store_true", help="lines are space-separated token ids, not text")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="the models' dtype (torch)")
    p.add_argument("--backend", choices=BACKENDS, default=None, help=flags.BACKEND_HELP)
    p.add_argument("--precision", choices=PRECISIONS, default=None, help=flags.PRECISION_HELP)
    p.add_argument("--device", type=device_arg, default="auto", help=f"where the models run: {DEVICE_HELP}")
    flags.add_target_flags(p)
    io = p.add_argument_group("inputs and outputs")
    io.add_argument("--input", metavar="FILE", help="read the lines from FILE (default: stdin)")
    io.add_argument("--output", metavar="FILE", help="write the records to FILE (default: stdout)")
    io.add_argument("--batch-size", type=_positive, default=DEFAULT_BATCH_SIZE,
                    help="lines decoding at once, their steps in shared forwards; 1: one at a time, each line "
                         "read once the one before it is done (latency measurements, interactive use)")
    io.add_argument("--workers", type=_workers, default="auto",
                    help="model workers of a batched run, each with its own rows over one copy of the models and "
                         "its share of the lines (CTranslate2's inter_threads); default auto: on a CPU with "
                         "ONNX Runtime, one per usable CPU (per --threads CPUs), each with at least "
                         f"{ROWS_PER_WORKER} of the batch's lines; else one")
    io.add_argument("--threads", type=_positive, default=None,
                    help="intra-op threads of each model worker (default: the usable CPUs shared out)")
    io.add_argument("--unordered", action="store_true",
                    help="write each record as soon as its line is done, with its line number, not in input order")
    io.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="the progress line on stderr (default: on when stderr is a terminal)")
    flags.add_decoding_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """`Engine.load` and `LocalEngine.bulk` over the input's lines: one JSON record a line; a bad line
    gets an error record and the rest go on (exit status 2 if any failed, 130 when interrupted)."""
    from decoding.request import Policy
    from specdec.api import Engine

    workers = auto_workers(args) if args.workers == "auto" else args.workers
    engine = Engine.load(args.bundle, backend=args.backend, precision=args.precision, device=args.device,
                         dtype=args.dtype, policy=Policy(flags=True), threads=args.threads,
                         workers=workers if args.batch_size > 1 else 1)
    overrides = {k: v for k, v in flags.decoding_overrides(args).items() if v is not None}
    engine.prepare_config(overrides)  # a bad flag is one error for the run, before any line is read
    with _open_input(args.input) as lines, _open_output(args.output) as out:
        total = _count_lines(args.input) if args.input else None
        requests = (_line_request(engine, number, line.rstrip("\n"), args, overrides)
                    for number, line in enumerate(lines, start=1))
        shown = args.progress if args.progress is not None else sys.stderr.isatty()
        writer = _Writer(out, args.unordered, progress(total) if shown else None)
        run = engine.bulk(requests, args.batch_size, ordered=not args.unordered, workers=workers,
                          threads=args.threads)
        try:
            for index, outcome in run:
                writer.write(index, outcome)
        except KeyboardInterrupt:
            # What finished is written (with its line number: it may follow a gap), then exit 130.
            writer.unordered = True
            for index, outcome in run.finished():
                writer.write(index, outcome)
            writer.close(interrupted=True)
            return 130
        writer.close()
    return 2 if writer.failed else 0


class _Writer:
    """Writes each outcome as a JSON line (and failures as a line on stderr), and keeps the count."""

    def __init__(self, out: TextIO, unordered: bool, bar: Progress | None) -> None:
        self.out = out
        self.unordered = unordered
        self.bar = bar
        self.failed = 0

    def write(self, index: int, outcome: Any) -> None:
        line = index + 1
        if isinstance(outcome, SpecdecError):
            self.failed += 1
            message = f"specdec decode: error: {outcome.code.value}: line {line}: {outcome.message}"
            if self.bar is not None:
                self.bar.note(message)
            else:
                print(message, file=sys.stderr)
            record: dict[str, Any] = {"line": line, "error": outcome.message, "code": outcome.code.value}
            tokens = 0
        else:
            record = {"line": line} if self.unordered else {}
            record |= outcome.record()
            tokens = len(outcome.output_ids)
        print(json.dumps(record, ensure_ascii=False), file=self.out, flush=True)
        if self.bar is not None:
            self.bar.advance(tokens)

    def close(self, interrupted: bool = False) -> None:
        if self.bar is not None:
            self.bar.close(interrupted)


def _line_request(engine, number: int, line: str, args: argparse.Namespace, overrides: dict):
    """One stdin line as a request (text, or ids with --ids), or the SpecdecError of a malformed one."""
    try:
        ids = _parse_ids(line) if args.ids and line.strip() else None
    except SpecdecError as exc:
        return exc
    prefix = flags.target_prefix(args)
    if ids is not None:
        return engine.request(ids, args.target_lang, overrides, prefix)
    return engine.request(line if line.strip() else [], args.target_lang, overrides, prefix)


def _open_input(path: str | None) -> contextlib.AbstractContextManager[TextIO]:
    if path is None:
        return contextlib.nullcontext(sys.stdin)
    return open(path, encoding="utf-8")


def _open_output(path: str | None) -> contextlib.AbstractContextManager[TextIO]:
    if path is None:
        return contextlib.nullcontext(sys.stdout)
    return open(path, "w", encoding="utf-8")


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def auto_workers(args: argparse.Namespace) -> int:
    """`--workers auto` (see its help): the model workers of a batched run on this machine."""
    from core.backends import DEFAULT_BACKEND
    from core.threads import usable_cpus
    from seq2seq_models.ort_runner import resolve_device

    if args.batch_size == 1 or (args.backend or DEFAULT_BACKEND) != "onnxruntime":
        return 1
    if resolve_device(args.device, onnx=True) != "cpu":
        return 1
    cpus = usable_cpus() // (args.threads or 1)
    return max(1, min(cpus, args.batch_size // ROWS_PER_WORKER))


def _workers(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return _positive(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or auto)") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parse_ids(line: str) -> list[int]:
    from core.errors import invalid

    try:
        return [int(tok) for tok in line.split()]
    except ValueError:
        raise invalid(f"--ids expects space-separated integers, got {line[:40]!r}") from None
