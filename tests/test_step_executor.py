"""The model worker releases what a cancelled caller would have received (a session being opened
when its stream is cancelled), and hands results to callers that stay."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serving.sessions import StepExecutor


def test_a_result_nobody_waits_for_any_more_is_released() -> None:
    executor = StepExecutor("test")
    started, finish, released = threading.Event(), threading.Event(), threading.Event()
    made: list[object] = []

    def make() -> object:
        started.set()
        finish.wait(10)
        made.append(object())
        return made[-1]

    async def main() -> None:
        def release(thing: object) -> None:
            if thing is made[0]:
                released.set()

        task = asyncio.ensure_future(executor.run_owned(make, release))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        task.cancel()  # the stream ends while its session is still being made
        with pytest.raises(asyncio.CancelledError):
            await task
        finish.set()
        await asyncio.get_running_loop().run_in_executor(None, released.wait, 10)

    asyncio.run(main())
    executor.shutdown()
    assert released.is_set() and len(made) == 1


def test_a_caller_that_waits_gets_the_result_and_nothing_is_released() -> None:
    executor = StepExecutor("test")
    released: list[object] = []

    async def main() -> int:
        return await executor.run_owned(lambda: 42, released.append)

    assert asyncio.run(main()) == 42
    executor.shutdown()
    assert released == []


def test_fire_and_forget_work_runs_even_past_a_shutdown() -> None:
    """A closing session frees its pool slots through `submit`: queued when the worker shuts down it
    still runs, and submitted afterwards it runs on the caller's thread."""
    executor = StepExecutor("test")
    started, finish = threading.Event(), threading.Event()
    ran: list[tuple[str, str]] = []

    def busy() -> None:
        started.set()
        finish.wait(10)

    worker_call = threading.Thread(target=executor.run_sync, args=(busy,))
    worker_call.start()
    assert started.wait(10)
    executor.submit(lambda: ran.append(("queued", threading.current_thread().name)))
    cancelled: list[object] = []
    waiter = threading.Thread(target=lambda: cancelled.append(_outcome(executor)))
    waiter.start()
    executor.shutdown()
    finish.set()
    executor.join(10)
    worker_call.join(10)
    waiter.join(10)
    executor.submit(lambda: ran.append(("after", threading.current_thread().name)))
    assert ran == [("queued", ran[0][1]), ("after", threading.current_thread().name)]
    assert ran[0][1] != threading.current_thread().name  # the worker ran it before exiting
    assert cancelled and isinstance(cancelled[0], BaseException)  # a waiting result is cancelled, not run


def _outcome(executor: StepExecutor) -> object:
    try:
        return executor.run_sync(lambda: "ran")
    except BaseException as exc:  # the cancellation is the outcome under test
        return exc
