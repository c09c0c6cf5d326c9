"""Stopping background tasks (`plait.tasks.cancel_and_wait`): a task that lost
its cancellation (as Python 3.11's wait_for can lose one) still ends, and a stop that
is itself cancelled is cancelled, not carried on."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

import pace
from plait.tasks import TaskSet, cancel_and_wait


async def swallows_one_cancellation(started: asyncio.Event) -> None:
    started.set()
    # Lost, as wait_for loses one that arrives as its inner step completes.
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.Event().wait()
    await asyncio.Event().wait()  # runs on until cancelled again


async def old_stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_task_that_lost_its_cancellation_still_ends() -> None:
    started = asyncio.Event()
    task = asyncio.create_task(swallows_one_cancellation(started))
    await started.wait()
    async with pace.within(10, "the task that swallowed a cancellation to end"):
        await cancel_and_wait(task)
    assert task.cancelled()


async def test_the_old_way_waited_for_ever_on_it() -> None:
    started = asyncio.Event()
    task = asyncio.create_task(swallows_one_cancellation(started))
    await started.wait()
    stopping = asyncio.create_task(old_stop(task))
    await asyncio.sleep(0.5)
    assert not stopping.done()  # and never would be
    await cancel_and_wait(task)
    await stopping


async def test_a_cancelled_stop_is_cancelled() -> None:
    """The old way swallowed the caller's cancellation: a test stuck in a stop, cancelled
    at its timeout, went on to its next step instead of ending."""
    keep_going = True

    async def stubborn() -> None:
        while keep_going:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    stop = asyncio.create_task(cancel_and_wait(task))
    await asyncio.sleep(0.3)
    stop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stop
    keep_going = False
    await cancel_and_wait(task)
    assert task.done()


async def test_tasks_already_done_are_fine() -> None:
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    await cancel_and_wait(done)
    await cancel_and_wait()


async def test_a_task_set_owns_its_tasks_until_they_end_and_aclose_waits_for_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = TaskSet("the test")
    started = asyncio.Event()
    finished = asyncio.Event()

    async def quick() -> None:
        finished.set()

    async def fails() -> None:
        raise RuntimeError("the background step broke")

    forever = tasks.start(swallows_one_cancellation(started), "plait-test-forever")
    tasks.start(quick(), "plait-test-quick")
    failing = tasks.start(fails(), "plait-test-fails")
    await started.wait()
    await finished.wait()
    await asyncio.wait([failing])
    await asyncio.sleep(0)  # the done callbacks run
    assert len(tasks) == 1  # the ended ones left the set
    # Nobody awaited the failed one: the set said so, naming owner, task and error.
    (record,) = [r for r in caplog.records if "the background step broke" in str(r.exc_info)]
    assert record.getMessage() == "the test: task plait-test-fails failed"
    async with pace.within(10, "the task set to close"):
        await tasks.aclose()
    assert forever.cancelled()
    assert len(tasks) == 0
