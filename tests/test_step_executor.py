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
