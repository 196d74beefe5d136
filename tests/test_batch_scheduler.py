"""The continuous-batching scheduler (serving/batching.py) on real verifier sessions of a tiny
model: which steps share a forward, in what order, and what happens to a step whose caller left,
whose session closed, or whose forward failed. The run function is the real one-by-one fallback
(`one_by_one` over `session.step`), wrapped only to record the batches it was handed."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from core.errors import SpecdecError, StatusCode
from core.greedy import greedy_next
from core.interfaces import StepCall
from seq2seq_models.transformer import Seq2SeqTransformer
from serving.batching import BatchLimits, BatchScheduler, BatchStats, StepExecutor, one_by_one, with_batch_load
from tests.zoo import config
from verifier_service.session import LocalVerifier

SOURCES = ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 6], [7, 7, 8], [10, 5, 9, 11, 12, 13])


@pytest.fixture(scope="module")
def verifier() -> LocalVerifier:
    torch.manual_seed(0)
    return LocalVerifier(Seq2SeqTransformer(config()).double().eval())


class Recorder:
    """A real run function (each step on its session, in turn) that remembers every batch and the
    thread it ran on."""

    def __init__(self) -> None:
        self.batches: list[list[StepCall]] = []
        self.threads: set[int] = set()
        self.stats: list[BatchStats] = []

    def __call__(self, items):
        self.batches.append([call for _, call in items])
        self.threads.add(threading.get_ident())
        started = time.perf_counter()
        results = one_by_one(items, _step)
        rows, tokens = sum(c.n_rows for _, c in items), sum(c.n_tokens for _, c in items)
        return with_batch_load(results, rows, tokens, time.perf_counter() - started)

    def sizes(self) -> list[int]:
        return [len(b) for b in self.batches]


def _step(session, call: StepCall):
    return session.step(call.committed_len, call.append_ids, call.draft_ids, call.top_k)


def _scheduler(limits: BatchLimits | None = None) -> tuple[StepExecutor, BatchScheduler, Recorder]:
    executor = StepExecutor("test")
    recorder = Recorder()
    scheduler = BatchScheduler(executor, recorder, limits or BatchLimits(), on_batch=recorder.stats.append)
    return executor, scheduler, recorder


class Hold:
    """Keeps the worker busy (a task blocked on an event), so steps queue up behind it."""

    def __init__(self, executor: StepExecutor) -> None:
        self.started, self.go = threading.Event(), threading.Event()
        self.task = asyncio.ensure_future(executor.run(self._block))

    def _block(self) -> None:
        self.started.set()
        self.go.wait(10)

    async def __aenter__(self) -> Hold:
        await asyncio.get_running_loop().run_in_executor(None, self.started.wait, 10)
        return self

    async def __aexit__(self, *exc) -> None:
        self.go.set()
        await self.task


async def _queued(scheduler: BatchScheduler, session, call: StepCall) -> asyncio.Task:
    task = asyncio.ensure_future(scheduler.submit(session, call))
    await asyncio.sleep(0)  # let it reach the queue, so queue order is submit order
    return task


def test_ragged_steps_queued_together_share_one_forward_with_sequential_results(verifier) -> None:
    """Different cached lengths, appends, drafts and a rollback, in one batch, FIFO; each result is
    what the same step gives run alone."""
    # The same sessions stepped alone, for the expected results.
    alone = [verifier.open(s) for s in SOURCES]
    warm = [StepCall(0, [5, 6, 7], [8, 9], 3), StepCall(0, [6], [], 3), StepCall(0, [], [7, 8, 9, 10], 3)]
    for session, call in zip(alone[:3], warm, strict=True):
        _step(session, call)
    steps = [
        StepCall(3, [11], [12, 13, 14], 4),  # keeps 3 of 5: rolls the draft back
        StepCall(1, [], [], 2),  # a plain AR step after 1 token
        StepCall(2, [9], [5], 1),  # rolls back below its draft too
        StepCall(0, [5, 6, 7, 8, 9, 10, 11], [12], 3),  # a fresh session, long append
        StepCall(0, [], [5, 6], 5),
    ]
    expected = [_step(s, c) for s, c in zip(alone, steps, strict=True)]

    async def main():
        executor, scheduler, recorder = _scheduler()
        sessions = [verifier.open(s) for s in SOURCES]
        for session, call in zip(sessions[:3], warm, strict=True):
            await scheduler.submit(session, call)
        recorder.batches.clear()
        async with Hold(executor):
            tasks = [await _queued(scheduler, s, c) for s, c in zip(sessions, steps, strict=True)]
        results = await asyncio.gather(*tasks)
        executor.shutdown()
        return recorder, results

    recorder, results = asyncio.run(main())
    assert recorder.batches == [steps]  # one forward, in submit order
    for got, want in zip(results, expected, strict=True):
        assert (got.top1, got.topk_ids) == (want.top1, want.topk_ids)
        # float64: the same up to the last bits (a batch's padded attention may sum in another order).
        for got_row, want_row in zip(got.topk_logprobs, want.topk_logprobs, strict=True):
            assert got_row == pytest.approx(want_row, rel=1e-12, abs=1e-12)
        assert got.draft_logprobs == pytest.approx(want.draft_logprobs, rel=1e-12, abs=1e-12)
        assert got.batch_rows == 5 and got.batch_tokens == sum(c.n_tokens for c in steps)
    assert recorder.stats[-1].items == 5 and recorder.stats[-1].rows == 5


def test_limits_cut_batches_in_fifo_order_and_a_too_big_step_runs_alone(verifier) -> None:
    small = StepCall(0, [5, 6], [7, 8], 1)  # 4 tokens
    big = StepCall(0, [5] * 12, [6] * 8, 1)  # 20 tokens: over max_tokens on its own

    async def main():
        executor, scheduler, recorder = _scheduler(BatchLimits(max_rows=3, max_tokens=10))
        async with Hold(executor):
            # 7 small steps: rows cut them 3 + 3 + 1... except tokens cut first: 4 + 4 (+4 > 10).
            tasks = [await _queued(scheduler, verifier.open([5, 6]), small) for _ in range(5)]
            tasks.append(await _queued(scheduler, verifier.open([5, 6]), big))
            tasks.append(await _queued(scheduler, verifier.open([5, 6]), small))
        await asyncio.gather(*tasks)
        async with Hold(executor):
            rows_bound = [await _queued(scheduler, verifier.open([5]), StepCall(0, [], [], 1)) for _ in range(7)]
        await asyncio.gather(*rows_bound)
        executor.shutdown()
        return recorder

    recorder = asyncio.run(main())
    # Tokens: [4, 4] [4, 4] [4] then the big step alone (the small one behind it is not let past it),
    # then the last small one. Rows: 7 one-token steps in [3, 3, 1].
    assert recorder.sizes() == [2, 2, 1, 1, 1, 3, 3, 1]
    assert recorder.batches[3] == [big]
    assert all(s.rows <= 3 and (s.tokens <= 10 or s.items == 1) for s in recorder.stats)


def test_a_step_whose_caller_was_cancelled_while_queued_never_runs(verifier) -> None:
    """Its stream ended (cancelled) and its session was closed behind it: the others' forward goes
    on without it, and the close runs after."""
    calls = [StepCall(0, [5], [6], 1), StepCall(0, [7], [8, 9], 1), StepCall(0, [], [10], 1)]

    async def main():
        executor, scheduler, recorder = _scheduler()
        sessions = [verifier.open(s) for s in SOURCES[:3]]
        async with Hold(executor):
            tasks = [await _queued(scheduler, s, c) for s, c in zip(sessions, calls, strict=True)]
            tasks[1].cancel()
            await asyncio.sleep(0)
            executor.submit(sessions[1].close)  # what SessionStreams does when a stream ends
        done = await asyncio.gather(*tasks, return_exceptions=True)
        closed = await executor.run(lambda: sessions[1].closed)
        executor.shutdown()
        return recorder, done, closed

    recorder, done, closed = asyncio.run(main())
    assert recorder.batches == [[calls[0], calls[2]]]
    assert isinstance(done[1], asyncio.CancelledError)
    assert done[0].batch_rows == done[2].batch_rows == 2
    assert recorder.stats[0].dropped == 1 and closed


def test_a_failing_step_fails_only_its_caller(verifier) -> None:
    ok = StepCall(0, [5], [6], 1)
    out_of_step = StepCall(4, [], [5], 1)  # keeps 4 tokens of a session that has seen none

    async def main():
        executor, scheduler, recorder = _scheduler()
        async with Hold(executor):
            tasks = [await _queued(scheduler, verifier.open([5, 6]), c) for c in (ok, out_of_step, ok)]
        done = await asyncio.gather(*tasks, return_exceptions=True)
        executor.shutdown()
        return recorder, done

    recorder, done = asyncio.run(main())
    assert recorder.sizes() == [3]
    assert isinstance(done[1], SpecdecError) and done[1].code == StatusCode.FAILED_PRECONDITION
    assert done[0].top1 == done[2].top1 and len(done[0].top1) == 2


def test_a_failing_forward_fails_only_its_own_batch(verifier) -> None:
    failures = iter([RuntimeError("the device fell over")])

    def run(items):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return one_by_one(items, _step)

    async def main():
        executor = StepExecutor("test")
        scheduler = BatchScheduler(executor, run, BatchLimits(max_rows=2))
        async with Hold(executor):
            tasks = [await _queued(scheduler, verifier.open([5]), StepCall(0, [], [], 1)) for _ in range(3)]
        done = await asyncio.gather(*tasks, return_exceptions=True)
        after = await scheduler.submit(verifier.open([6]), StepCall(0, [], [], 1))
        executor.shutdown()
        return done, after

    done, after = asyncio.run(main())
    assert [type(d) for d in done[:2]] == [RuntimeError, RuntimeError] and str(done[0]) == "the device fell over"
    assert len(done[2].top1) == 1 and len(after.top1) == 1  # the next batch, and later steps, run


def test_batch_wait_gathers_steps_that_arrive_a_little_later(verifier) -> None:
    call = StepCall(0, [5], [6], 1)

    async def two_steps(wait_s: float, max_rows: int = 32) -> tuple[Recorder, float]:
        executor, scheduler, recorder = _scheduler(BatchLimits(max_rows=max_rows, wait_s=wait_s))
        started = time.perf_counter()
        first = asyncio.ensure_future(scheduler.submit(verifier.open([5]), call))
        await asyncio.sleep(0.3)
        await scheduler.submit(verifier.open([6]), call)
        await first
        executor.shutdown()
        return recorder, time.perf_counter() - started

    waited, _ = asyncio.run(two_steps(wait_s=1.0))
    assert waited.sizes() == [2]
    eager, _ = asyncio.run(two_steps(wait_s=0.0))  # 0: the first step runs at once, alone
    assert eager.sizes() == [1, 1]

    async def full_batch_does_not_wait() -> float:
        executor, scheduler, _ = _scheduler(BatchLimits(max_rows=2, wait_s=5.0))
        started = time.perf_counter()
        await asyncio.gather(*(scheduler.submit(verifier.open([5]), call) for _ in range(2)))
        executor.shutdown()
        return time.perf_counter() - started

    assert asyncio.run(full_batch_does_not_wait()) < 2.0


def test_tasks_and_batches_share_the_one_worker_thread_in_queue_order(verifier) -> None:
    """Opening and closing sessions (tasks) and steps (batches) run on one thread, and a task queued
    between two steps does not hold them apart."""
    executor, scheduler, recorder = _scheduler()
    batches_before_open: list[int] = []

    def open_session():
        batches_before_open.append(len(recorder.batches))
        return verifier.open([7])

    async def main():
        session = await executor.run(verifier.open, [5, 6])
        task_thread = await executor.run(threading.get_ident)
        async with Hold(executor):
            a = await _queued(scheduler, session, StepCall(0, [5], [], 1))
            opening = asyncio.ensure_future(executor.run(open_session))
            await asyncio.sleep(0)
            b = await _queued(scheduler, verifier.open([8]), StepCall(0, [6], [], 1))
        await asyncio.gather(a, b, opening)
        executor.shutdown()
        return task_thread

    task_thread = asyncio.run(main())
    assert recorder.threads == {task_thread}
    # The batch at the head took both steps, passing over the open queued between them; the open next.
    assert recorder.sizes() == [2] and batches_before_open == [1]


def test_shutdown_cancels_what_is_queued(verifier) -> None:
    async def main():
        executor, scheduler, recorder = _scheduler()
        async with Hold(executor):
            task = await _queued(scheduler, verifier.open([5]), StepCall(0, [], [], 1))
            executor.shutdown()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(RuntimeError):
            await executor.run(int)
        executor.submit(int)  # after shutdown: nothing, no error (a late session close)
        return recorder

    assert asyncio.run(main()).batches == []


def _greedy_then(steps: int, eos_id: int, room: int):
    def then(call: StepCall, result, steps_run: int):
        return greedy_next(call, result, steps_run, steps, eos_id, room)

    return then


def test_runs_of_greedy_steps_interleave_with_other_sessions_and_equal_single_steps(verifier) -> None:
    """Two sessions' greedy runs submitted once: each next step is queued by the worker, so the runs
    share every forward (two rows) and answer what step-by-step decoding gives."""
    eos, room = verifier.eos_id, verifier.max_target_len
    expected = []
    for source in SOURCES[:2]:
        session = verifier.open(source)
        expected.append(session.step_greedy(0, [], 6, 1).top1)  # in process, one step after another
        session.close()

    async def main():
        executor, scheduler, recorder = _scheduler()
        sessions = [verifier.open(s) for s in SOURCES[:2]]
        async with Hold(executor):
            tasks = [
                asyncio.ensure_future(scheduler.submit(s, StepCall(0, [], [], 1), _greedy_then(6, eos, room)))
                for s in sessions
            ]
            await asyncio.sleep(0.05)
        runs = await asyncio.gather(*tasks)
        executor.shutdown()
        return recorder, runs

    recorder, runs = asyncio.run(main())
    for run, want in zip(runs, expected, strict=True):
        assert [r.top1[0] for r in run] == want
    lengths = [len(w) for w in expected]
    # Every forward holds one step of each run still going.
    assert recorder.sizes() == [sum(n > i for n in lengths) for i in range(max(lengths))]


def test_in_process_runs_continue_without_waiting_for_callers_busy_elsewhere(verifier) -> None:
    """In process (the executor knows its callers), a forward of nothing but runs' continuations
    starts at once: the callers not queued are busy on their threads (here one whose run has ended),
    so waiting for them (wait_s) would only idle the worker. A first step still waits for them."""
    eos, room = -1, verifier.max_target_len  # no EOS: each run takes exactly its steps

    async def main(callers: int) -> tuple[Recorder, float]:
        executor = StepExecutor("test", callers=lambda: callers)
        recorder = Recorder()
        scheduler = BatchScheduler(executor, recorder, BatchLimits(wait_s=1.5))
        short, long = verifier.open(SOURCES[0]), verifier.open(SOURCES[1])
        started = time.perf_counter()
        await asyncio.gather(scheduler.submit(short, StepCall(0, [], [], 1), _greedy_then(2, eos, room)),
                             scheduler.submit(long, StepCall(0, [], [], 1), _greedy_then(5, eos, room)))
        executor.shutdown()
        return recorder, time.perf_counter() - started

    recorder, seconds = asyncio.run(main(callers=2))
    assert recorder.sizes() == [2, 2, 1, 1, 1]
    assert seconds < 1.0  # three continuations alone, none waiting its 1.5 s for the finished caller
    recorder, seconds = asyncio.run(main(callers=3))  # a third caller that never comes: the first step waits
    assert recorder.sizes() == [2, 2, 1, 1, 1] and seconds >= 1.4


def test_a_cancelled_run_stops_and_its_queued_step_never_runs(verifier) -> None:
    """Cancelling the caller mid-run: the step queued next is dropped, no further step is queued."""

    async def main():
        executor, scheduler, recorder = _scheduler()
        session = verifier.open(SOURCES[2])
        steps_seen = []
        loop = asyncio.get_running_loop()
        cancelled = threading.Event()

        def then(call, result, steps_run):
            steps_seen.append(steps_run)
            if steps_run == 2:  # as a client's cancel would, while the run is under way
                loop.call_soon_threadsafe(task.cancel)
                loop.call_soon_threadsafe(cancelled.set)
                cancelled.wait(5)  # the loop has cancelled the caller: the rule below sees it
            return greedy_next(call, result, steps_run, 50, -1, verifier.max_target_len)

        task = asyncio.ensure_future(scheduler.submit(session, StepCall(0, [], [], 1), then))
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
        ran = len(recorder.batches)
        executor.shutdown()
        return ran, steps_seen

    ran, steps_seen = asyncio.run(main())
    # Cancelled during step 2's continuation: step 3 is queued, then dropped before it runs.
    assert ran == 2 and steps_seen == [1, 2]


def test_a_run_whose_worker_shuts_down_mid_run_fails_its_callers(verifier) -> None:
    """The worker shut down while a forward of two runs' steps ran: their next steps cannot be queued,
    and both callers (one on an event loop, one on a thread of its own) get the error instead of
    waiting for ever."""
    eos, room = -1, verifier.max_target_len

    async def main() -> tuple[BaseException | None, BaseException | None, int]:
        executor = StepExecutor("test")
        recorder = Recorder()

        def run_batch(items):
            if len(recorder.batches) == 1:  # the second forward: as a shutdown from elsewhere would
                executor.shutdown()
            return recorder(items)

        scheduler = BatchScheduler(executor, run_batch)
        on_loop, on_thread = verifier.open(SOURCES[0]), verifier.open(SOURCES[1])
        async with Hold(executor):
            task = asyncio.ensure_future(scheduler.submit(on_loop, StepCall(0, [], [], 1), _greedy_then(9, eos, room)))
            threaded = scheduler.queue_sync(on_thread, StepCall(0, [], [], 1), _greedy_then(9, eos, room))
            await asyncio.sleep(0.05)
        loop_error = thread_error = None
        try:
            await asyncio.wait_for(task, 5)
        except RuntimeError as exc:
            loop_error = exc
        try:
            threaded.result(timeout=5)
        except RuntimeError as exc:
            thread_error = exc
        return loop_error, thread_error, len(recorder.batches)

    loop_error, thread_error, forwards = asyncio.run(main())
    assert forwards == 2
    assert "shut down" in str(loop_error) and "shut down" in str(thread_error)
