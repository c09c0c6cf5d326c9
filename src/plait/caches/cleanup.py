"""Deleting old invalidation rows (R-CA-4), in bounded batches.

A reader needs an invalidation row only until it has applied it: live, within
moments; after a disconnect, when it catches up. Rows older than the retention (default
7 days) are deleted, oldest IDs first, `batch` rows at most per statement, so a large
backlog never turns into one long-running DELETE. While a batch finds old rows and more
may follow, the next runs after a short pause; otherwise after `interval`. Every
instance runs the job; an advisory lock lets one clean at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from plait.errors import DatabaseUnavailableError
from plait.storage.cache_rows import delete_old_rows
from plait.storage.database import Database

logger = logging.getLogger(__name__)

DEFAULT_RETENTION = 7 * 24 * 3600.0  # seconds
DEFAULT_BATCH = 1000
DEFAULT_INTERVAL = 3600.0  # seconds between runs when there is no backlog
DEFAULT_PAUSE = 0.1  # seconds between batches while there is one


@dataclass(frozen=True, slots=True)
class Batch:
    """What one run did: rows deleted, and whether more old rows may follow."""

    deleted: int
    more: bool


def next_delay(batch: Batch | None, *, pause: float, interval: float) -> float:
    """Soon while there is a backlog; else (also after a failure, or when another
    instance holds the lock: `batch` None) after `interval`."""
    return pause if batch is not None and batch.more else interval


class InvalidationCleanup:
    """The cleanup job of one instance."""

    def __init__(
        self,
        db: Database,
        *,
        retention: float = DEFAULT_RETENTION,
        batch: int = DEFAULT_BATCH,
        interval: float = DEFAULT_INTERVAL,
        pause: float = DEFAULT_PAUSE,
        on_deleted: Callable[[int], None] | None = None,
    ) -> None:
        if retention <= 0 or batch < 1 or interval <= 0 or pause < 0:
            raise ValueError("need retention > 0, batch >= 1, interval > 0, pause >= 0")
        self._db = db
        self.retention = retention
        self.batch = batch
        self.interval = interval
        self.pause = pause
        self._on_deleted = on_deleted

    async def clean_once(self) -> Batch | None:
        """Delete one batch; None when another instance is cleaning right now."""
        async with self._db.transaction() as txn:
            done = await delete_old_rows(txn, self.batch, self.retention)
        if done is None:
            return None
        deleted, seen = done
        if deleted:
            logger.info("caches: deleted %d invalidation rows older than the retention", deleted)
            if self._on_deleted is not None:
                self._on_deleted(deleted)
        # A full head with old rows in it: the rows after it may be old too.
        return Batch(deleted, more=deleted > 0 and seen == self.batch)

    async def run(self) -> None:
        """Clean forever (a background task; cancel it to stop)."""
        while True:
            try:
                batch = await self.clean_once()
            except (psycopg.Error, DatabaseUnavailableError, OSError) as err:
                logger.warning("caches: deleting old invalidation rows failed: %s", err)
                batch = None
            await asyncio.sleep(next_delay(batch, pause=self.pause, interval=self.interval))
