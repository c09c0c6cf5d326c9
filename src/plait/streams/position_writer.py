"""Keeps a writer's row in `stream_positions` current, off the write path (R-ID-8).

After a write completes the writer is poked; one background task upserts the newest
position a little later (`delay`), so at most one upsert is in flight and the writes of
that window (a burst, or a steady stream) cost one upsert between them.
Every `interval` it also refreshes the other writers' positions from the database (so
an idle writer learns how far the others got) and flushes its idle-advanced position
if that moved: readers that only see the database never stall on an idle writer.

Upserts commit asynchronously (no wait for a WAL flush, `StreamStore.upsert_position`),
so a crash of PostgreSQL loses those of its last moments (R-ID-14: a position must not
go backwards, also through a restart). Two cheap stores make up for it: after a
connection of the process was found dead (the server restarted or crashed; the
count `lost()` grew) the current position is stored again, durably; and the last
store, at stop, is durable. A writer that dies with the server restarts above the
sequence head (`WriterRows.register`). See "Positions through a crash" in
`core/positions.py`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import psycopg

from plait.core.backoff import Backoff
from plait.storage.server_errors import connection_lost
from plait.tasks import let_finish

logger = logging.getLogger(__name__)
FINAL_FLUSH_TIMEOUT = 5.0  # seconds: stopping never waits longer for the last store


class PositionWriter:
    def __init__(
        self,
        *,
        current: Callable[[], int],
        upsert: Callable[[int, bool], Awaitable[None]] | None,
        refresh: Callable[[], Awaitable[None]] | None,
        interval: float,
        written: int,
        name: str,
        delay: float,
        lost: Callable[[], int] = lambda: 0,
    ) -> None:
        self._current = current
        self._upsert = upsert  # (position, durable)
        self._refresh = refresh
        self._interval = interval
        # After a write, wait this long before storing, so the writes of that window
        # cost one upsert between them instead of one each.
        self._delay = delay
        # Stored, perhaps only asynchronously (a crash may take it back to `_durable`),
        # and stored durably (`written` was registered so).
        self._written = written
        self._durable = written
        self._lost = lost
        self._lost_seen = lost()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._name = name
        self.upserts = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"plait-positions-{self._name}")

    def poke(self) -> None:
        """A write completed: store the new position soon."""
        self._wake.set()

    async def flush(self, *, durable: bool = False) -> None:
        """Store the current position if it moved since the last store; `durable`: if
        it moved since the last durable one."""
        if self._upsert is None:
            return
        lost = self._lost()
        if lost != self._lost_seen:
            # A connection died since the last store: if the server crashed, what was
            # stored asynchronously before may be gone. Store it again, durably.
            self._written = self._durable
            durable = True
        value = self._current()
        if value > (self._durable if durable else self._written):
            await self._upsert(value, durable)
            self._written = max(self._written, value)
            if durable:
                self._durable = max(self._durable, value)
            self.upserts += 1
        self._lost_seen = lost  # only once stored: a failed store is tried again

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time() + self._interval
        failures = 0
        # After a failed store: half a second, growing to one interval at most.
        backoff = Backoff(initial=min(0.5, self._interval), cap=self._interval)
        while not self._stopping:
            try:
                async with asyncio.timeout(max(0.0, next_tick - loop.time())):
                    await self._wake.wait()
            except TimeoutError:
                pass
            if self._stopping:
                break
            if self._wake.is_set() and self._delay > 0:
                await asyncio.sleep(self._delay)
            self._wake.clear()
            try:
                if loop.time() >= next_tick:
                    next_tick = loop.time() + self._interval
                    if self._refresh is not None:
                        await self._refresh()
                await self.flush()
                failures = 0
                backoff.up()
            except Exception as err:
                failures += 1
                log = logger.warning if failures in (1, 10) or failures % 100 == 0 else logger.debug
                log("%s: could not update stream_positions (%s); retrying", self._name, err)
                await asyncio.sleep(backoff.next_delay())
                self._wake.set()

    async def stop(self, *, final_flush: bool = True) -> None:
        """Let an upsert in progress finish (cancelling one mid-transaction would leave its
        connection in an unknown state), then store the final position."""
        task, self._task = self._task, None
        self._stopping = True
        self._wake.set()
        if task is not None:
            await let_finish(task)
        if final_flush:
            try:
                async with asyncio.timeout(FINAL_FLUSH_TIMEOUT):
                    await self._final_flush()
            except Exception as err:
                logger.warning("%s: final position flush failed: %s", self._name, err)

    async def _final_flush(self) -> None:
        """Durable, and again on a new connection when the one it got was dead (the
        server restarted since this process last used it): a restart right after this
        one's must find the position (see the module docstring)."""
        backoff = Backoff(initial=0.05, cap=1.0)
        while True:
            try:
                await self.flush(durable=True)
                return
            except psycopg.OperationalError as err:
                if not connection_lost(err):
                    raise
            await asyncio.sleep(backoff.next_delay())
