"""A live one-line progress display for the labelling and each drafter's training."""

from __future__ import annotations

import time
from typing import TextIO


class ProgressLine:
    """"label done/total unit, rate, eta" on a terminal stream, redrawn at most every 0.2 s; nothing
    when `stream` is None. The rate counts from the first update, so a resumed run's rate is its own."""

    def __init__(self, stream: TextIO | None, label: str, total: int, unit: str) -> None:
        self.stream = stream
        self.label = label
        self.total = total
        self.unit = unit
        self.first: tuple[int, float] | None = None
        self.drawn = 0.0

    def show(self, done: int, note: str = "") -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = (done, now)
        if self.stream is None or (now - self.drawn < 0.2 and done < self.total):
            return
        self.drawn = now
        rate = (done - self.first[0]) / max(now - self.first[1], 1e-9)
        eta = (self.total - done) / rate if rate > 0 else 0.0
        text = f"\r{self.label}: {done}/{self.total} {self.unit} {rate:.1f}/s eta {eta:.0f} s {note}"
        self.stream.write(text.ljust(78))
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
