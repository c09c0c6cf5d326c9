"""The application's replication callbacks (`Listeners`), and how plait runs one: a
listener's failure is logged, never allowed to stop replication."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("plait.replication.handler")  # what operators filter on

RowsListener = Callable[[str, str, int, list[Any]], Awaitable[None] | None]
PositionListener = Callable[[str, str, int], Awaitable[None] | None]
ResetListener = Callable[[str, str], Awaitable[None] | None]
DepartureListener = Callable[[str], Awaitable[None] | None]
CommandListener = Callable[[Any], Awaitable[None] | None]


@dataclass
class Listeners:
    """The application's callbacks; each may be a plain function or a coroutine one."""

    rows: dict[str, list[RowsListener]] = field(default_factory=dict)
    positions: dict[str, list[PositionListener]] = field(default_factory=dict)
    resets: dict[str, list[ResetListener]] = field(default_factory=dict)
    departures: list[DepartureListener] = field(default_factory=list)
    commands: dict[str, CommandListener] = field(default_factory=dict)


def call_now(listener: Callable[..., Awaitable[None] | None], *args: Any) -> None:
    """Run a plain-function listener; see `call`."""
    try:
        result = listener(*args)
    except Exception:
        logger.exception("replication listener %r failed on %r", listener, args[:3])
        return
    if inspect.iscoroutine(result):
        result.close()
        logger.error(
            "replication listener %r returned a coroutine, which was not run: declare it "
            "with async def so plait awaits it",
            listener,
        )


def is_async(listener: Callable[..., Any]) -> bool:
    """Whether plait must await the listener (a coroutine function, or an object whose
    __call__ is one)."""
    return inspect.iscoroutinefunction(listener) or inspect.iscoroutinefunction(
        type(listener).__call__
    )


async def call(listener: Callable[..., Awaitable[None] | None], *args: Any) -> None:
    """Run one listener; its failure is logged, never allowed to stop replication (the
    rows were delivered to it once, as to every other listener)."""
    try:
        result = listener(*args)
        if inspect.isawaitable(result):
            await result
    except Exception:
        logger.exception("replication listener %r failed on %r", listener, args[:3])
