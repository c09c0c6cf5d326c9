"""How this writer's IDs complete, apart from the writes themselves.

`Finisher`: an ID completes at once when its write says what it wrote; one that may
have no row (rolled back, or a `get_next` block that wrote nothing) completes only once
PostgreSQL's log is flushed past it (R-ID-14). Either way the outbox hears of it first.

`Settler`: a statement that takes its IDs as it runs and loses its answer may have
committed rows nobody can name; the writer's position waits until the outcome is final,
then the range they may lie in is posted to the outbox as unknown (replication reads it
back) rather than skipped.
"""

from __future__ import annotations

import asyncio
import logging

import psycopg

from plait.core.backoff import Backoff
from plait.core.positions import FetchTicket
from plait.errors import FencedError, PlaitError
from plait.storage.stream_tables import StreamRow
from plait.storage.transaction import Transaction
from plait.streams.allocator import Fetches
from plait.streams.shared import Shared
from plait.tasks import TaskSet, cancel_and_wait

logger = logging.getLogger("plait.streams.generator")  # what operators filter on


class Finisher:
    """Completes this writer's IDs in its position tracker (`PositionTracker.complete`),
    telling the outbox first. `closed()` says the generator is closing: nothing more
    completes then."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        # IDs that finish once the WAL is flushed, and the task that flushes it.
        self._unflushed: list[int] = []
        self._flusher: asyncio.Task[None] | None = None

    def complete_after(
        self, txn: Transaction, ids: list[int], rows: list[StreamRow] | None = None
    ) -> None:
        """`ids`, written in `txn`, complete once it commits (with these rows), or, rolled
        back or with an unknown outcome, as `finish_flushed`."""
        txn.call_after(lambda: self.finish(ids, rows))
        # Rolled back, or a COMMIT whose outcome is unknown: rows not known either way.
        txn.call_on_exception(lambda: self.finish_flushed(ids))

    def finish(self, ids: list[int], rows: list[StreamRow] | None = None) -> None:
        self._shared.outbox.written(ids, rows)
        before = self._shared.tracker.local_position
        self._shared.tracker.complete(ids)
        self._shared.poke_if_moved(before)

    def finish_flushed(self, ids: list[int]) -> None:
        """IDs that may have finished without a row count as finished once the WAL is
        on disk (R-ID-14). PostgreSQL logs a sequence 32 values ahead, and only a flush
        of the WAL makes that record survive a crash; a rollback flushes nothing. So
        until then a crash could bring the sequence back below these IDs, to hand them
        out again, after this writer reported them as its position. One flush serves
        every ID queued before it began; the position waits for it (and, the server
        down, for its return)."""
        if not ids or self._shared.closed():
            return
        if self._shared.db.fenced:
            # Its connections are refused until none of its IDs is pending: finish them
            # now so it can go on as a new incarnation. The fence that stopped it
            # committed, durably, once all of its server processes had ended, which
            # flushed the WAL past these IDs' sequence record; and should a crash have
            # lost that record before, the connection that found the fence had first
            # moved the sequence past them (`Database`, new connections).
            self.finish(ids)
            return
        self._unflushed.extend(ids)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(
                self._flush_then_finish(), name=f"plait-flush-{self._shared.name}"
            )

    def finish_if_flushed(self, txn: Transaction, ids: list[int]) -> None:
        """`get_next_txn`'s IDs after COMMIT: see `finish_durable`."""
        if txn.flushed_lsn is not None and txn.flushed_lsn >= txn.allocated_lsn:
            self.finish(ids)
        else:
            self.finish_flushed(ids)

    async def finish_durable(self, ids: list[int], lsn: int) -> None:
        """A `get_next()` block that exited normally may have written no row: its IDs
        finish once the WAL is on disk up to where it stood after their allocation
        (`StreamStore.make_durable`), for the reason `finish_flushed` gives. When the
        block committed its row through this `Database`, that commit said so: no round
        trip; else one statement. Should that fail (the server down), they finish as
        `finish_flushed` does."""
        if not ids or self._shared.closed():
            return
        try:
            if not self._shared.db.fenced:
                await self._shared.store.make_durable(lsn)
        except FencedError:
            pass  # see `finish_flushed`
        except (psycopg.Error, OSError, PlaitError):
            self.finish_flushed(ids)
            return
        except BaseException:  # cancelled: they still finish, later
            self.finish_flushed(ids)
            raise
        self.finish(ids)

    async def _flush_then_finish(self) -> None:
        """See `finish_flushed`. Cancelled (at close), the IDs stay unfinished: a
        position held back is safe."""
        backoff = Backoff(initial=0.05, cap=1.0)
        failures = 0
        while self._unflushed:
            batch = self._unflushed.copy()  # what this flush covers; later ones wait
            try:
                await self._shared.store.flush_wal()
            except FencedError:
                pass  # this run writes nothing more (see `finish_flushed`)
            except (psycopg.Error, OSError, PlaitError) as err:
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    logger.warning(
                        "stream %s: could not flush PostgreSQL's log before IDs that "
                        "may have no row (rolled back, or written nothing with) count "
                        "as finished (%s); this writer's position waits for it",
                        self._shared.name,
                        err,
                    )
                await asyncio.sleep(backoff.next_delay())
                continue
            del self._unflushed[: len(batch)]
            self.finish(sorted(batch))

    async def close(self) -> None:
        """Stop flushing: IDs still waiting for it stay unfinished (a position held back
        is safe)."""
        if self._flusher is not None:
            await cancel_and_wait(self._flusher)


class Settler:
    """Settles the writes whose outcome was lost (see the module's docstring)."""

    def __init__(self, shared: Shared, fetches: Fetches) -> None:
        self._shared = shared
        self._fetches = fetches
        self._tasks = TaskSet(f"stream {shared.name}")

    def unsettled(self, ticket: FetchTicket, backend_pid: int | None) -> bool:
        """A statement that takes its IDs as it runs failed without saying which, or
        whether it committed (its connection broke). For a captured writer, keep the
        ticket, so this writer's position stays below whatever it took, until the
        outcome is final and the sequence head says how far its IDs may reach; then
        mark that range unknown. Otherwise the position would move past a committed row
        and replication would claim nothing lies there. False: end the ticket as usual
        (without an open outbox, readers read every range from the database anyway)."""
        if not self._shared.outbox.is_open:
            return False
        self._tasks.start(self._settle(ticket, backend_pid), f"plait-settle-{self._shared.name}")
        return True

    async def _settle(self, ticket: FetchTicket, backend_pid: int | None) -> None:
        """See `unsettled`. Cancelled (at close), it leaves the ticket open: a position
        held back is safe, one moved past a row is not."""
        if backend_pid is not None:
            await self._shared.db.wait_finished(backend_pid=backend_pid)
        low = ticket.floor - 1  # the sequence gave the statement nothing below the floor
        high, backoff = low, Backoff(initial=0.05, cap=5.0)
        while True:
            try:
                high = await self._shared.store.sequence_head()
                break
            except FencedError:
                break  # others moved this run's position on; it writes nothing more
            except (psycopg.Error, OSError) as err:
                logger.warning(
                    "stream %s: cannot read the sequence head after a write whose outcome "
                    "was lost (%s); this writer's position waits for it",
                    self._shared.name,
                    err,
                )
                await asyncio.sleep(backoff.next_delay())
        self._shared.outbox.unknown(low, high)
        self.end_empty(ticket)

    def end_empty(self, ticket: FetchTicket) -> None:
        """End a fetch that handed out nothing (or nothing anyone can name)."""
        before = self._shared.tracker.local_position
        self._fetches.end(ticket, [])
        self._shared.poke_if_moved(before)

    def lost(self, ticket: FetchTicket) -> None:
        """A fetch's IDs may have committed unnamed: settle it, or end it at once."""
        if not self.unsettled(ticket, None):
            self.end_empty(ticket)

    async def close(self) -> None:
        """Stop settling: tickets not settled yet stay open (a position held back)."""
        await self._tasks.aclose()
