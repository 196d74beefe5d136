"""A bulk run's progress on stderr: lines done, output tokens/s and the time left.

On a terminal it is a tqdm bar redrawn in place; elsewhere (a log file, CI) a plain line every
`LOG_EVERY_S` seconds and one at the end, since a bar's carriage returns would fill a log with
partial lines.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

# How often a progress line is written when stderr is not a terminal.
LOG_EVERY_S = 5.0


def progress(total: int | None, stream: TextIO | None = None) -> Progress:
    """A progress display for `total` lines (None: unknown, no time left shown) on `stream` (stderr)."""
    stream = stream or sys.stderr
    return Progress(total, stream, bar=stream.isatty())


class Progress:
    def __init__(self, total: int | None, stream: TextIO, bar: bool) -> None:
        self.total = total
        self.stream = stream
        self.lines = 0
        self.tokens = 0
        self.started = time.perf_counter()
        self._logged = self.started
        self._bar = None
        if bar:
            from tqdm import tqdm

            # No monitor thread: a daemon thread that may write to stderr while the interpreter
            # shuts down can abort it.
            tqdm.monitor_interval = 0

            # A terminal that reports no size (a bare pty) would get no bar at all: assume 80 x 24.
            sized = _sized(stream)
            self._bar = tqdm(total=total, unit="line", file=stream, dynamic_ncols=sized, ncols=None if sized else 80,
                             nrows=None if sized else 24, leave=True)

    def advance(self, tokens: int) -> None:
        """One more line done, with `tokens` output tokens."""
        self.lines += 1
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(f"{self.rate():.0f} tok/s", refresh=False)
        elif time.perf_counter() - self._logged >= LOG_EVERY_S:
            self._logged = time.perf_counter()
            print(self.summary(), file=self.stream, flush=True)

    def note(self, message: str) -> None:
        """A line of its own (an input's error), kept apart from the bar."""
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self, interrupted: bool = False) -> None:
        if self._bar is not None:
            self._bar.close()
        print(self.summary(final=True, interrupted=interrupted), file=self.stream, flush=True)

    def rate(self) -> float:
        elapsed = time.perf_counter() - self.started
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def summary(self, final: bool = False, interrupted: bool = False) -> str:
        elapsed = time.perf_counter() - self.started
        done = f"{self.lines}/{self.total}" if self.total is not None else f"{self.lines}"
        text = f"specdec decode: {done} lines, {self.tokens} tokens, {self.rate():.1f} tokens/s, {elapsed:.1f}s"
        if interrupted:
            return text + ", interrupted"
        if not final and self.total and self.lines:
            left = elapsed / self.lines * (self.total - self.lines)
            text += f", about {left:.0f}s left"
        return text


def _sized(stream: TextIO) -> bool:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError):
        return False
    return size.columns > 0 and size.lines > 0
