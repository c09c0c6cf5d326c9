"""plait's background tasks: who owns them, and how they are stopped.

Every task plait starts has an owner that waits for it when it stops: a `TaskSet`
(`aclose()` cancels and waits for every task still running), or one attribute that the
owner's `close()` hands to `cancel_and_wait` / `let_finish`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)

# How often a task that swallowed its cancellation is cancelled again.
_CANCEL_AGAIN = 0.1


async def cancel_and_wait(*tasks: asyncio.Task[object]) -> None:
    """Cancel `tasks` and wait until each has ended, cancelling again one that goes on.

    Awaiting a cancelled task inside `suppress(CancelledError)` has two faults: it also
    swallows a cancellation of the caller, and it waits for ever on a task that
    swallowed its own cancellation. Python 3.11's `asyncio.wait_for` (psycopg_pool's
    wait for a connection) and redis-py while connecting can lose one when it arrives
    as their inner step completes, and the task then runs on: a stop hung there (an
    instance's stop never sent its DEPART, under load). `asyncio.wait` passes the
    caller's cancellation on and never raises the task's."""
    pending = {task for task in tasks if not task.done()}
    rounds = 0
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=_CANCEL_AGAIN)
        rounds += 1
        if pending and rounds == 10:
            logger.warning(
                "still cancelling %s after %.0f s (a cancellation was lost)",
                ", ".join(sorted(task.get_name() for task in pending)),
                rounds * _CANCEL_AGAIN,
            )


async def let_finish(task: asyncio.Task[None], patience: float = 10.0) -> None:
    """Wait for `task` to end on its own, and cancel it only after `patience` seconds:
    cancelling a task in the middle of a statement leaves its connection (and the IDs
    or positions it was handling) in an unknown state."""
    try:
        async with asyncio.timeout(patience):
            await asyncio.shield(task)
    except TimeoutError:
        await cancel_and_wait(task)


class TaskSet:
    """Tasks started for one owner, which `aclose()` cancels and waits for. A task
    leaves the set when it ends; one that fails logs its error, since nobody awaits it
    (a task whose outcome its owner awaits does not belong in a set). `len()` counts
    the tasks still running, so an empty set is falsy."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Run `coro` as a task of this set."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.add(task)
        return task

    def add(self, task: asyncio.Task[Any]) -> None:
        """Own a task started elsewhere."""
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "%s: task %s failed", self._owner, task.get_name(), exc_info=task.exception()
            )

    def __len__(self) -> int:
        return len(self._tasks)

    async def aclose(self) -> None:
        """Cancel every task still running and wait until each has ended."""
        await cancel_and_wait(*self._tasks)

    async def wait(self) -> None:
        """Wait until every task of the set has ended on its own (tasks a task starts
        meanwhile too)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))


async def to_the_end(step: Awaitable[T]) -> tuple[T, bool]:
    """Await `step` to its end even if the caller is cancelled meanwhile, however often:
    a COMMIT or a connection's close stopped half-way leaves it in an unknown state.

    Returns its result and whether a cancellation arrived meanwhile; the caller acts on
    how the step ended first, then re-raises that cancellation. A step that raised
    raises here.
    """
    task = asyncio.ensure_future(step)
    cancelled = False
    while True:
        try:
            return await asyncio.shield(task), cancelled
        except asyncio.CancelledError:
            cancelled = True
            if task.done():
                if task.cancelled():
                    raise
                return task.result(), True  # the step's outcome (or its exception)
