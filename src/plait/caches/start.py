"""Where a process starts reading the `caches` stream.

An any-writer stream starts at the largest ID in its table (R-ID-12). For caches that
alone is not safe: a row with a smaller ID may still be on its way to COMMIT, and a
process that started past it would never apply it, although it may already have cached
the data that row invalidates. Invalidation rows are written only in COMMIT's round
trip, so a transaction holding an uncommitted caches ID is always about to finish:
starting under a SHARE lock on the table waits for those (milliseconds) and keeps new
ones out until the start position is read. Every ID at or below it is then final.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import psycopg

from plait.storage.cache_rows import hold_back_writers
from plait.storage.database import Database

logger = logging.getLogger(__name__)
T = TypeVar("T")
LOCK_TIMEOUT = "5s"


async def fenced(db: Database, start: Callable[[], Awaitable[T]]) -> T:
    """Run `start` (which reads the start position) while no caches row is in flight;
    after `LOCK_TIMEOUT` of waiting, warn and run it anyway."""
    try:
        async with db.transaction() as txn:
            await hold_back_writers(txn, LOCK_TIMEOUT)
            return await start()
    except psycopg.errors.LockNotAvailable:
        logger.warning(
            "caches: a transaction has held an invalidation uncommitted for over %s; "
            "starting without waiting for it (if it commits later, this process may "
            "miss that one invalidation)",
            LOCK_TIMEOUT,
        )
        return await start()
