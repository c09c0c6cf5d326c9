"""Fences dead writers of one stream (the I/O around `core.fencing.HoldWatch`).

A background task looks at the positions a few times per `fence_after`; when the watch
names a writer that has held the stream too long, it runs `WriterRows.fence` and hands
a success to `fenced(writer, position)`: the generator advances it (or replication
announces it and catches up its rows first).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import psycopg

from plait.core.fencing import HoldWatch
from plait.storage.stream_store import StreamStore
from plait.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


class Fencer:
    def __init__(
        self,
        store: StreamStore,
        positions: Callable[[], dict[str, int]],
        fenced: Callable[[str, int], None],
        *,
        fence_after: float,
        own: str | None,
    ) -> None:
        self._store = store
        self._positions = positions  # internal domain, every writer known
        self._fenced = fenced
        self._watch = HoldWatch(fence_after, own)
        self._tick = min(max(fence_after / 10, 0.02), 0.5)
        self._task: asyncio.Task[None] | None = None
        self._epochs: dict[str, int] = {}  # the epoch each writer was last fenced at
        self._unfenceable: set[str] = set()  # said so once
        self.fences = 0  # successful fences that moved a position

    @property
    def started(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"plait-fencer-{self._store.spec.name}")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._tick)
            positions = self._positions()
            if not positions:
                continue
            writer: str | None = None
            try:
                head = None
                if self._watch.needs_head(positions, time.monotonic()):
                    head = await self._store.sequence_head()
                writer = self._watch.candidate(positions, time.monotonic(), head)
                if writer is None:
                    continue
                await self._attempt(writer, max(positions.values()), positions[writer])
            except (psycopg.Error, OSError) as err:
                if writer is not None:
                    self._watch.tried(writer, time.monotonic(), fenced=False)
                logger.warning("stream %s: could not try fencing: %s", self._store.spec.name, err)

    async def _attempt(self, writer: str, target: int, before: int) -> None:
        """Try to fence `writer` up to `target` (`before`: where it is now)."""
        result = await self._store.writers.fence(writer, target)
        now = time.monotonic()
        name = self._store.spec.name
        if result.epoch is None:
            self._watch.tried(writer, now, fenced=False)
            if writer in self._unfenceable:
                return
            self._unfenceable.add(writer)
            logger.info(
                "stream %s: %s holds it but registered no incarnation (an older plait, or a "
                "database pool shared between instances), so it cannot be fenced",
                name,
                writer,
            )
            return
        if result.position is None:
            self._watch.tried(writer, now, fenced=False)
            logger.debug(
                "stream %s: %s holds it with %d connection(s) alive: not fenced",
                name,
                writer,
                result.alive,
            )
            return
        self._watch.tried(writer, now, fenced=True, moved=result.position > before)
        if self._epochs.get(writer) != result.epoch:
            self._epochs[writer] = result.epoch
            logger.warning(
                "stream %s: fenced %s (epoch %d): none of its connections is alive, so "
                "everything it wrote is committed or rolled back; its position moves "
                "from %d to %d and keeps following the others until it restarts",
                name,
                writer,
                result.epoch,
                before,
                result.position,
            )
        if result.position > before:
            self.fences += 1
            self._fenced(writer, result.position)
