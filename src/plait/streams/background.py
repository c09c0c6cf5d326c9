"""Stopping plait's background tasks."""

from __future__ import annotations

import asyncio
import contextlib


async def let_finish(task: asyncio.Task[None], patience: float = 10.0) -> None:
    """Wait for `task` to end on its own, and cancel it only after `patience` seconds:
    cancelling a task in the middle of a statement leaves its connection (and the IDs
    or positions it was handling) in an unknown state."""
    try:
        async with asyncio.timeout(patience):
            await asyncio.shield(task)
    except TimeoutError:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
