"""Handling one inbound command until it is handled: a failure (database or peer out
of reach) drops the connection, so that the transport reconnects and catches up afresh,
and the command is tried again after a growing delay, as a catch-up from the source
where it can be. The commands behind it build on it: a row is delivered when its token
is above what was seen, so skipping one would skip its rows. Once the new connection
got that far, the catch-up has nothing left to read. Past `RETRY_FOR` s of failures the
connection's commands are given up (said at ERROR): what they carried arrives with the
writer's next POSITION."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from plait.core.backoff import Backoff

logger = logging.getLogger("plait.replication.handler")  # what operators filter on

# A command whose handling failed is tried again after these delays (seconds), growing,
# for this long; then the connection's commands are given up.
RETRY_INITIAL = 0.1
RETRY_CAP = 10.0
RETRY_FOR = 300.0

W = TypeVar("W")


class GivenUp(Exception):
    """A command failed for `RETRY_FOR` s: its worker ends."""


async def handle_surely(
    handle: Callable[[W], Awaitable[None]],
    command: W,
    *,
    label: Callable[[W], str],
    link: str,
    on_failure: Callable[[], None],
    stopping: Callable[[], bool],
    as_catch_up: Callable[[W], W],
) -> None:
    """`handle(command)`, tried again while it fails (see the module). `on_failure`
    drops the connection; `as_catch_up` is what to try in place of a failed command.
    Raises `GivenUp` past `RETRY_FOR` s; returns at once when `stopping()`."""
    retry = Backoff(initial=RETRY_INITIAL, cap=RETRY_CAP)
    failures = 0
    deadline = time.monotonic() + RETRY_FOR
    while True:
        try:
            await handle(command)
            return
        except Exception as err:
            on_failure()
            if stopping():
                return
            failures += 1
            if time.monotonic() > deadline:
                logger.error(
                    "replication: %s on %s failed for %.0f s (%s: %s); giving up the "
                    "commands of this connection: what they carried arrives with the "
                    "writer's next POSITION",
                    label(command),
                    link,
                    RETRY_FOR,
                    type(err).__name__,
                    err,
                )
                raise GivenUp from err
            if failures & (failures - 1) == 0:  # 1st, 2nd, 4th, 8th...: not a flood
                logger.warning(
                    "replication: %s on %s failed (%s: %s); trying again as a catch-up "
                    "(failure %d)",
                    label(command),
                    link,
                    type(err).__name__,
                    err,
                    failures,
                )
            command = as_catch_up(command)
            await asyncio.sleep(retry.next_delay())
