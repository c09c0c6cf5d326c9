"""Outlasting a server that went away: the one retry loop of plait's database work, and
the one warning per outage that its waiters share."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import psycopg

from plait.core.backoff import Backoff
from plait.errors import (
    DatabaseUnavailableError,
)
from plait.storage.server_errors import reason_of

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Outage:
    """When the server was first found unreachable, while it stays so: every waiter
    of one `Database` shares it, so an outage logs one warning, not one per reader."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None


async def outlast(
    step: Callable[[], Awaitable[T]],
    *,
    patience: float,
    server: str,
    doing: str,
    transient: Callable[[psycopg.OperationalError], bool],
    giving_up: Callable[[float, str], DatabaseUnavailableError],
    outage: Outage,
) -> T:
    """`await step()`, again after a `transient` failure, with backoff, until
    `patience` seconds have passed since the first failure; then `giving_up(seconds,
    reason)` is raised. The one retry loop of plait's database work (reads, start-up,
    connecting): what it waits for ("could not `doing` yet") is logged when the outage
    begins, and when it ends."""
    loop = asyncio.get_running_loop()
    backoff = Backoff(initial=0.05, cap=2.0)
    first_failure: float | None = None
    last: psycopg.OperationalError | None = None
    while True:
        try:
            if first_failure is None:
                result = await step()
            else:
                # A lease may wait for the pool's timeout (30 s) for a connection
                # the pool cannot make: the patience left bounds each attempt.
                left = first_failure + patience - loop.time()
                async with asyncio.timeout(max(left, 0.0)):
                    result = await step()
        except psycopg.OperationalError as err:
            if not transient(err):
                raise
            last = err
        except TimeoutError:
            if first_failure is None:
                raise  # the step's own, not the patience's
        else:
            since, outage.since = outage.since, None
            if since is not None:
                logger.warning("PostgreSQL at %s is back after %.1f s", server, loop.time() - since)
            return result
        now = loop.time()
        reason = "no connection" if last is None else reason_of(last)
        if first_failure is None:
            first_failure = now
        if now - first_failure >= patience:
            raise giving_up(now - first_failure, reason) from last
        if outage.since is None:  # one line per outage, not per waiter
            outage.since = now
            logger.warning(
                "could not %s yet: PostgreSQL at %s is unreachable (%s); trying again with "
                "backoff for up to %.0f s",
                doing,
                server,
                reason,
                patience,
            )
        await asyncio.sleep(backoff.next_delay())
