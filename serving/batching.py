"""The model worker and its continuous-batching scheduler (ARCHITECTURE.md, "Performance design").

`StepExecutor` is the one thread model work runs on, off the event loop. Its queue holds two kinds
of work, in arrival order:

- tasks (`run`, `run_owned`, `submit`): opening and closing sessions, warm-up, any one-off call;
- steps (`BatchScheduler.submit`): one session's step each. Whenever the worker is free and the
  oldest entry is a step, it takes every pending step of that scheduler, in order, up to
  `max_rows` rows and `max_tokens` tokens (a step that does not fit ends the batch and heads the
  next one, so nobody is overtaken; a single step bigger than the limits runs alone), waiting at
  most `wait_s` for company when the batch is not full, and runs them as one `run_batch` call.

One queue keeps each session's work in order: a session's close is queued after its last step,
and a stream's next step only after its previous one was answered, so a batch may pass over a
task (another session's open or close) without reordering anything of one session. A step whose
caller was cancelled while queued is dropped and never reaches the model; one step failing
fails only its own caller; `run_batch` itself raising fails only that batch's callers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Sized(Protocol):
    """What the scheduler reads off a call (core.interfaces.StepCall, the drafter's BlockCall)."""

    @property
    def n_rows(self) -> int: ...

    @property
    def n_tokens(self) -> int: ...


# run_batch: [(session, call), ...] -> one result per item, in order; an item's exception is its
# result (it fails that item only).
RunBatch = Callable[[list[tuple[Any, Any]]], Sequence[Any]]
# then(call, result, results so far) -> the session's next call, or None: a run of steps submitted
# once (multi-step greedy decoding, core.greedy); the worker queues each next step itself.
Then = Callable[[Any, Any, int], Any]


@dataclass(frozen=True)
class BatchLimits:
    """How much one forward may hold, and how long a step may wait for company (0: never)."""

    max_rows: int = 32
    max_tokens: int = 512
    wait_s: float = 0.0

    @classmethod
    def of(cls, limits: Any) -> BatchLimits:
        """From a service's limits (serving.model_service.SessionLimits): its batch keys."""
        return cls(limits.max_batch_rows, limits.max_batch_tokens, limits.batch_wait_ms / 1000.0)


@dataclass(frozen=True)
class BatchStats:
    """One forward, as `on_batch` hears of it (on the worker thread, before the results go out)."""

    items: int  # steps in it
    rows: int  # their rows (a multi-row step counts each)
    tokens: int  # their tokens (StepCall.n_tokens)
    forward_s: float  # the run_batch call's duration
    waits_s: tuple[float, ...]  # each step's time from submit to the forward's start
    dropped: int  # steps whose callers were cancelled while queued (never run)


class StepExecutor:
    """Runs model work off the event loop, on one worker thread, in the order it was queued.

    One thread, because torch already uses every core inside one op and two forwards would only
    contend; batching (`BatchScheduler`) is how several sessions share a forward.
    """

    def __init__(self, name: str, callers: Callable[[], int] | None = None) -> None:
        self.name = name
        # In process, how many threads may queue work soon (`specdec.bulk`): a scheduler waiting for
        # company (`BatchLimits.wait_s`) stops waiting once that many entries are queued, since
        # nobody else can come. None: unknown (a service's callers are remote).
        self.callers = callers
        self._cond = threading.Condition()
        self._queue: deque[_Task | _Step] = deque()
        self._closed = False
        self._thread: threading.Thread | None = None

    async def run(self, fn, *args):
        """`fn(*args)` on the worker. A caller cancelled before it starts: it never runs."""
        return await self._task(fn, args, None)

    async def run_owned(self, fn, release, *args):
        """`run` for work that makes something its caller must release (a session). If the caller is
        cancelled before the work is done, nobody would receive the result: `release(result)` runs
        on the worker as soon as the work finishes instead, so nothing is leaked."""
        # The release runs on the worker too: model objects are only touched from that thread.
        return await self._task(fn, args, lambda made: self.submit(release, made))

    def run_sync(self, fn, *args) -> Any:
        """`run` for a caller on a thread of its own, with no event loop: waits for `fn(*args)` on
        the worker and returns its result (or raises its exception)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_Task(fn, args, future, None))
        return future.result()

    def submit(self, fn, *args) -> None:
        """Fire and forget (closing a session): `fn(*args)` on the worker. Such work frees what a
        session holds (its slots of a model's pool), so it is never dropped: queued at shutdown it
        still runs on the worker before it exits, and submitted after it runs on the caller's thread
        (the model's owner locks what it frees)."""
        try:
            self._put(_Task(fn, args, None, None))
        except RuntimeError:  # shut down
            fn(*args)

    def shutdown(self) -> None:
        """Cancel everything queued but fire-and-forget work (which still runs); the work running now
        finishes; the worker then exits."""
        with self._cond:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._queue.extend(e for e in pending if isinstance(e, _Task) and e.future is None)
            self._cond.notify_all()
        for entry in pending:
            if entry.future is not None:
                _call_soon(entry.future, entry.future.cancel)

    def join(self, timeout: float | None = None) -> None:
        """After `shutdown`: wait until the worker has finished the work it was running and exited
        (in process, before the interpreter exits: a daemon thread stopped inside a model call
        aborts the process)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ---- the queue -----------------------------------------------------------------------------

    async def _task(self, fn, args, release):
        future = asyncio.get_running_loop().create_future()
        self._put(_Task(fn, args, future, release))
        return await future

    def _put(self, entry: _Task | _Step) -> None:
        self._put_all([entry])

    def _put_all(self, entries: list[_Task | _Step]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the {self.name} model worker is shut down")
            self._queue.extend(entries)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=f"{self.name}-model", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed and not self._queue:
                    return
                head = self._queue[0]
                if isinstance(head, _Task):
                    self._queue.popleft()
                    job: Callable[[], None] | None = head.run
                else:
                    job = head.scheduler._take(self._queue, self._cond)
            if job is not None:
                try:
                    job()
                except Exception:  # a bug in delivery or metrics must not kill the only worker
                    log.exception("the %s model worker's job failed", self.name)


class BatchScheduler:
    """Gathers the steps of many sessions into one `run_batch` call on an executor's worker.

    `await scheduler.submit(session, call)` returns `run_batch`'s result for that item, or raises
    its exception. `on_batch(BatchStats)` runs on the worker after every forward (metrics).
    """

    def __init__(
        self,
        executor: StepExecutor,
        run_batch: RunBatch,
        limits: BatchLimits = BatchLimits(),
        on_batch: Callable[[BatchStats], None] | None = None,
    ) -> None:
        if limits.max_rows < 1 or limits.max_tokens < 1 or limits.wait_s < 0:
            raise ValueError(f"batch limits must be positive; got {limits}")
        self.executor = executor
        self.run_batch = run_batch
        self.limits = limits
        self.on_batch = on_batch

    async def submit(self, session: Any, call: Sized, then: Then | None = None) -> Any:
        """Queue one step; its result once the forward it joined has run. Cancelling the caller
        while the step is queued drops it (it never runs); once running, its result is discarded.

        With `then`, a run of steps: after each, on the worker, `then(call, result, n)` names the
        next call (queued at once, behind what is queued already, so it joins a later forward like
        any step) or ends the run; the answer is the list of the run's results. The caller's event
        loop is not woken between the steps. A step failing ends the run with its exception."""
        return await self.queue(session, call, then)

    def queue(self, session: Any, call: Sized, then: Then | None = None) -> asyncio.Future:
        """`submit` without waiting: the step is in the queue when this returns (on the event loop);
        the future is its answer, and cancelling it while the step is queued drops the step."""
        future = asyncio.get_running_loop().create_future()
        self._put_step(session, call, then, future)
        return future

    def queue_sync(self, session: Any, call: Sized, then: Then | None = None) -> concurrent.futures.Future:
        """`queue` for a caller on a thread of its own, with no event loop (in-process decoding): the
        worker settles the returned future itself."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put_step(session, call, then, future)
        return future

    def _put_step(self, session: Any, call: Sized, then: Then | None, future: Future) -> None:
        step = _Step(self, session, call, future, time.perf_counter(), call.n_rows, call.n_tokens)
        if then is not None:
            step.then, step.run = then, []
        self.executor._put(step)

    # ---- the worker's side ---------------------------------------------------------------------

    def _take(self, queue: deque, cond: threading.Condition) -> Callable[[], None] | None:
        """Under `cond`, with one of this scheduler's steps at the head of `queue`: remove the next
        batch from the queue (waiting up to wait_s for company) and return the job that runs it;
        None when nothing is left to run (every step gathered was cancelled)."""
        limits = self.limits
        callers = self.executor.callers
        # In process the wait runs from now, when the worker is free: the rows answered by the last
        # forward need a moment to queue their next steps. A service's steps wait from their arrival.
        freed = time.perf_counter()
        while True:
            batch, dropped, full = self._scan(queue)
            if not batch or full or not limits.wait_s:
                break
            if callers is not None and all(step.run for step in batch):
                # Nothing but runs' continuations (AR steps the worker queued itself): the callers not
                # queued are busy on their threads (a row finishing, an accept loop), and waiting for
                # them would only idle the worker; they join a later forward.
                break
            if callers is not None and _callers_queued(queue) >= callers():  # everyone who could come is queued
                break
            since = freed if callers is not None else batch[0].queued
            remaining = since + limits.wait_s - time.perf_counter()
            if remaining <= 0:
                break
            cond.wait(remaining)  # a new step wakes us; then look again
            if not queue:  # shut down meanwhile (only the worker removes entries otherwise)
                return None
        _remove(queue, [*batch, *dropped])
        if not batch:
            return None
        return lambda: self._run(batch, len(dropped))

    def _scan(self, queue: deque) -> tuple[list[_Step], list[_Step], bool]:
        """The next batch in queue order: (its steps, cancelled steps passed over, whether it is full)."""
        max_rows, max_tokens = self.limits.max_rows, self.limits.max_tokens
        batch: list[_Step] = []
        dropped: list[_Step] = []
        rows = tokens = 0
        for entry in queue:
            if not isinstance(entry, _Step) or entry.scheduler is not self:
                continue  # a task, or another scheduler's step: it keeps its place
            if entry.future.cancelled():
                dropped.append(entry)
                continue
            if batch and (rows + entry.rows > max_rows or tokens + entry.tokens > max_tokens):
                return batch, dropped, True  # it heads the next batch
            batch.append(entry)
            rows += entry.rows
            tokens += entry.tokens
            if rows >= max_rows or tokens >= max_tokens:
                return batch, dropped, True
        return batch, dropped, False

    def _run(self, batch: list[_Step], dropped: int) -> None:
        # A caller cancelled since the scan: drop it too (the last moment before the forward).
        live = [s for s in batch if not s.future.cancelled()]
        dropped += len(batch) - len(live)
        if not live:
            return
        started = time.perf_counter()
        try:
            results = list(self.run_batch([(s.session, s.call) for s in live]))
            if len(results) != len(live):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(live)} steps")
        except Exception as exc:  # the whole call failed: only this batch's steps fail with it
            results = [exc] * len(live)
        forward_s = time.perf_counter() - started
        # Observed before the results go out, so a caller that has its answer sees its forward counted.
        if self.on_batch is not None:
            stats = BatchStats(
                items=len(live),
                rows=sum(s.rows for s in live),
                tokens=sum(s.tokens for s in live),
                forward_s=forward_s,
                waits_s=tuple(started - s.queued for s in live),
                dropped=dropped,
            )
            try:
                self.on_batch(stats)
            except Exception:  # metrics must never cost a caller its result
                log.exception("on_batch failed")
        # One wake-up of the event loop per forward, not one per step: every callback through
        # call_soon_threadsafe writes the loop's self-pipe, and the loop wakes once per write.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any]]] = {}
        answers: list[tuple[_Step, Any]] = []
        following: list[_Step] = []  # runs' next steps, queued together (one wake-up of the worker)
        for step, result in zip(live, results, strict=True):
            result = result if step.then is None else self._continue(step, result)
            if isinstance(result, _Step):
                following.append(result)
            else:
                answers.append((step, result))
        if following:
            try:
                self.executor._put_all(following)
            except RuntimeError as exc:  # the worker shut down: those runs' callers hear it
                answers.extend((step, exc) for step in following)
        for step, result in answers:
            if isinstance(step.future, asyncio.Future):
                by_loop.setdefault(step.future.get_loop(), []).append((step.future, result))
            else:  # a thread's caller (`queue_sync`): no loop to go through
                _settle(step.future, result)
        for loop, settled in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the callers' loop is closed: nobody is left to tell
                loop.call_soon_threadsafe(_settle_all, settled)

    def _continue(self, step: _Step, result: Any) -> Any:
        """Worker: a run's step answered. Its next step (to queue) or what the caller gets: the run's
        results, or the exception that ended it."""
        if isinstance(result, BaseException):
            return result
        assert step.then is not None and step.run is not None
        step.run.append(result)
        try:
            call = None if step.future.cancelled() else step.then(step.call, result, len(step.run))
            if call is None:
                return step.run
            following = _Step(self, step.session, call, step.future, time.perf_counter(), call.n_rows, call.n_tokens)
            following.then, following.run = step.then, step.run
        except Exception as exc:  # a bad continuation: the caller hears it
            return exc
        return following


def one_by_one(items: list[tuple[Any, Any]], step: Callable[[Any, Any], Any]) -> list[Any]:
    """`run_batch` for a backend with no batched forward: `step(session, call)` for each item in
    turn, an item's exception being its result (the others still run)."""
    results: list[Any] = []
    for session, call in items:
        try:
            results.append(step(session, call))
        except Exception as exc:
            results.append(exc)
    return results


def with_batch_load(results: list[Any], rows: int, tokens: int, forward_s: float) -> list[Any]:
    """Results (`core.interfaces.VerifyResult` or `Draft`, or lists of them) stamped with the forward
    they ran in; exceptions pass through."""

    def stamp(result: Any) -> Any:
        if isinstance(result, BaseException):
            return result
        if isinstance(result, list):
            return [stamp(r) for r in result]
        return replace(result, batch_rows=rows, batch_tokens=tokens, forward_s=forward_s)

    return [stamp(r) for r in results]


# ---- internals -------------------------------------------------------------------------------


@dataclass(eq=False)
class _Task:
    fn: Callable[..., Any]
    args: tuple
    future: Future | None  # None: fire and forget
    release: Callable[[Any], None] | None  # run_owned: frees a result nobody waits for

    def run(self) -> None:
        future = self.future
        if future is None:
            self.fn(*self.args)
            return
        if future.cancelled():  # its caller is gone and nothing was made yet: skip it
            return
        try:
            result = self.fn(*self.args)
        except Exception as exc:
            _call_soon(future, _settle, future, exc)
            return
        if not isinstance(future, asyncio.Future):  # a thread's caller (`run_sync`)
            _settle(future, result)
            return
        if self.release is None:
            _call_soon(future, _settle, future, result)
        else:
            _call_soon(future, self._hand_over, result)

    def _hand_over(self, result: Any) -> None:
        """On the caller's loop, which alone decides whether the caller is still there (a cancel
        happens there too, so no race): give it the result, or release it when it was cancelled."""
        assert self.future is not None and self.release is not None
        if self.future.done():
            self.release(result)
        else:
            self.future.set_result(result)


# A step's answer: an asyncio future (a caller on an event loop) or a thread's (`queue_sync`).
Future = asyncio.Future | concurrent.futures.Future


@dataclass(eq=False)
class _Step:
    scheduler: BatchScheduler
    session: Any
    call: Any
    future: Future
    queued: float  # perf_counter at submit
    rows: int
    tokens: int
    then: Then | None = None  # a run of steps (BatchScheduler.submit): what follows this one
    run: list | None = None  # the run's results so far


def _callers_queued(queue: deque) -> int:
    """How many callers have work queued: the distinct sessions of the steps (a session may have an
    encoding and a step queued at once), and each task."""
    sessions = {id(e.session) for e in queue if isinstance(e, _Step)}
    return len(sessions) + sum(1 for e in queue if isinstance(e, _Task))


def _remove(queue: deque, entries: list) -> None:
    if not entries:
        return
    gone = {id(e) for e in entries}
    kept = [e for e in queue if id(e) not in gone]
    queue.clear()
    queue.extend(kept)


def _settle(future: Future, result: Any) -> None:
    if future.done():  # cancelled meanwhile: nobody wants it
        return
    # A thread's future may be cancelled by its caller between the check and the setting.
    with contextlib.suppress(concurrent.futures.InvalidStateError, asyncio.InvalidStateError):
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


def _settle_all(settled: list[tuple[asyncio.Future, Any]]) -> None:
    for future, result in settled:
        _settle(future, result)


def _call_soon(future: Future, fn: Callable[..., None], *args: Any) -> None:
    if not isinstance(future, asyncio.Future):  # a thread's caller: no loop to go through
        fn(*args)
        return
    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is left to tell
        future.get_loop().call_soon_threadsafe(fn, *args)

