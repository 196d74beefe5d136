"""Many inputs at once: rows admitted by length into lanes of decode threads, outputs in order.

`BulkRun` keeps up to `batch_size` inputs decoding at a time, each on a thread of its own, shared out
over `lanes` (model workers: `specdec.local_engine`), while the steps of a lane's rows share that
lane's batched forwards (`verifier_service.scheduled`, `drafter_service.scheduled`: the services'
scheduler, in process). Inputs are read a window ahead and admitted longest first within the
window: rows in flight have similar lengths (less padding in a forward), and the window's last rows
are its short ones, so a run does not end on a few long rows decoding alone.

Two admissions: continuous (a finished row's place is taken at once by the next), or in cohorts (a
lane takes its next rows all at once when its last row has finished, as CTranslate2's
translate_batch runs its batches). A forward attends over its longest past and longest source for
every row, so rows that start together and have similar lengths waste the least there: on a CPU,
cohorts beat refilling (BENCHMARKS.md, "Bulk decoding: where the time goes"). Outcomes come back in
input order, or as they finish.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from core.errors import SpecdecError

# How many inputs are read and sorted ahead, per row in flight: enough for rows of similar
# length to meet, few enough that the first outputs come soon.
WINDOW_PER_ROW = 8


@dataclass
class Pending:
    """An input read but not yet decoded: its index, and its prepared request or its error."""

    index: int
    item: Any  # what `decode` takes, or a SpecdecError
    length: int  # its source length, for admission


class BulkRun:
    """Iterating gives (index, outcome) of every item: `decode(item, stop, lane)`'s result, or the
    SpecdecError of an item that failed (its own, or one `decode` raised). At most `batch_size`
    decode at once, shared out evenly over `lanes` (`lane` is the item's, 0 .. lanes - 1), in
    `cohorts` or continuously (see the module docstring); `window` inputs (default
    `WINDOW_PER_ROW * batch_size`) are read ahead and admitted longest first. `decode` should give
    up soon once `stop` (a threading.Event) is set.

    Interrupted (KeyboardInterrupt while iterating), the rows in flight are told to stop, and
    `finished()` gives the outcomes that were done but not yet given out.

    `threads`: the decode threads' pool, of at least `batch_size` workers (fewer would hold rows
    back, unstarted), kept by its owner from run to run (`specdec.local_engine`); None: one of the
    run's own. A pool's threads start one at a time, each taking the interpreter lock from the
    thread admitting the next row, so a run starting a whole batch of new threads kept its model
    workers waiting (BENCHMARKS.md, "Bulk decoding: notes")."""

    def __init__(
        self, items: Iterable[Pending], decode: Callable[[Any, threading.Event, int], Any], batch_size: int,
        ordered: bool = True, window: int | None = None, on_close: Callable[[], None] | None = None,
        lanes: int = 1, cohorts: bool = False, threads: ThreadPoolExecutor | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1; got {batch_size}")
        if lanes < 1:
            raise ValueError(f"lanes must be at least 1; got {lanes}")
        self.items = iter(items)
        self.decode = decode
        self.batch_size = batch_size
        self.lanes = min(lanes, batch_size)
        self.lane_rows = -(-batch_size // self.lanes)  # a lane's rows at once (its cohort's size)
        self.cohorts = cohorts
        self.ordered = ordered
        self.window = window or WINDOW_PER_ROW * batch_size
        self.on_close = on_close  # called once the run ends (frees what the run made)
        self.stop = threading.Event()
        self.done: dict[int, Any] = {}
        self.rows = [0] * self.lanes  # each lane's rows admitted and not yet finished
        self.threads = threads

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        following = 0  # the next index to give out, in order
        pool = self.threads or ThreadPoolExecutor(max_workers=self.batch_size, thread_name_prefix="specdec-bulk")
        running: dict[Future, tuple[int, int]] = {}  # -> (the item's index, its lane)
        rows = self.rows
        queued: list[Pending] = []
        exhausted = False
        try:
            while True:
                for lane in self._admitting(rows):
                    admitted: list[Pending] = []
                    while rows[lane] + len(admitted) < self.lane_rows:
                        if not queued and not exhausted:
                            queued, exhausted = _read_window(self.items, self.window)
                        if not queued:
                            break
                        pending = queued.pop(0)
                        if isinstance(pending.item, SpecdecError):
                            self.done[pending.index] = pending.item
                        else:
                            admitted.append(pending)
                    # Counted before any starts: the lane's worker waits for all of them to join.
                    rows[lane] += len(admitted)
                    for pending in admitted:
                        running[pool.submit(self._outcome, pending.item, lane)] = (pending.index, lane)
                if not running and not queued and exhausted:
                    break
                if running:
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                    for future in finished:
                        index, lane = running.pop(future)
                        rows[lane] -= 1
                        self.done[index] = future.result()
                ready, following = _ready(self.done, following, self.ordered)
                yield from ready
            yield from self.finished()
        finally:
            self.stop.set()  # interrupted, or done: rows still in flight stop at their next block
            if pool is self.threads:  # the owner's: only this run's rows not started yet are dropped
                for future in running:
                    future.cancel()
            else:
                pool.shutdown(wait=False, cancel_futures=True)
            if self.on_close is not None:
                self.on_close()

    def _admitting(self, rows: list[int]) -> list[int]:
        """The lanes that take rows now, fewest rows first: in cohorts, the lanes with none left."""
        lanes = sorted(range(self.lanes), key=lambda lane: rows[lane])
        return [lane for lane in lanes if rows[lane] == 0] if self.cohorts else lanes

    def finished(self) -> list[tuple[int, Any]]:
        """The outcomes done and not given out yet, in input order (taken)."""
        out = sorted(self.done.items())
        self.done.clear()
        return out

    def _outcome(self, item: Any, lane: int) -> Any:
        try:
            return self.decode(item, self.stop, lane)
        except SpecdecError as exc:
            return exc


def _read_window(source: Iterator[Pending], window: int) -> tuple[list[Pending], bool]:
    """The next `window` inputs, longest first (stable: equal lengths keep input order), and
    whether the input is exhausted."""
    chunk = list(itertools.islice(source, window))
    return sorted(chunk, key=lambda p: -p.length), len(chunk) < window


def _ready(done: dict[int, Any], following: int, ordered: bool) -> tuple[list[tuple[int, Any]], int]:
    """The outcomes that may go out now (taken from `done`), and the next index due in order."""
    if not ordered:
        out = sorted(done.items())
        done.clear()
        return out, following
    out = []
    while following in done:
        out.append((following, done.pop(following)))
        following += 1
    return out, following
