"""`MultiWriterIdGenerator`: allocate stream IDs on one writer and follow every writer.

This wires small parts together: a `PositionTracker` (pure position logic), a
`StreamStore` (all SQL), an `IdAllocator` (shared round trips) and a `PositionWriter`
(the background upserts of this writer's row). Public values are signed: a backwards
stream shows negative IDs and positions, and `advance` takes them that way too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

from psycopg.rows import TupleRow, scalar_row, tuple_row

from plait.core.positions import FetchTicket, PositionTracker
from plait.core.spec import StreamSpec
from plait.errors import (
    ConfigError,
    NotAWriterError,
    StateError,
)
from plait.storage.database import Database
from plait.storage.identity import server_pid
from plait.storage.stream_store import StreamStore
from plait.storage.stream_tables import StreamRow
from plait.storage.transaction import Params, Transaction
from plait.streams.allocator import Fetches, IdAllocator, take_ids
from plait.streams.completion import Finisher, Settler
from plait.streams.fencer import Fencer
from plait.streams.others import OtherWriters
from plait.streams.outbox import Outbox
from plait.streams.position_writer import PositionWriter
from plait.streams.shared import Shared
from plait.streams.startup import load
from plait.streams.statements import Statements
from plait.streams.write_helpers import (
    IDS_UNKNOWN,
    InsertAtCommit,
    Parts,
    Reservation,
    check_count,
    column_names,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


DEFAULT_BATCH = 100
MAX_UPSERT_DELAY = 0.1  # seconds


class MultiWriterIdGenerator:
    """Stream IDs for one writer of a multi-writer stream, and the positions of all.

    Create with `await MultiWriterIdGenerator.create(db, spec, instance_name)`.
    """

    def __init__(
        self,
        db: Database,
        spec: StreamSpec,
        instance_name: str,
        store: StreamStore,
        tracker: PositionTracker,
        *,
        position_flush_interval: float,
        follow_database: bool,
        fence_after: float | None = None,
    ) -> None:
        self._db = db
        self._spec = spec
        self._instance = instance_name
        self._store = store
        self._tracker = tracker
        self._sign = spec.sign
        self._statements = statements = Statements(store)
        # Everything replication hears of this writer goes through here (`open_outbox`).
        self._outbox = Outbox(spec.sign)
        self._closed = False
        shared = Shared(
            db=db,
            spec=spec,
            instance_name=instance_name,
            store=store,
            tracker=tracker,
            outbox=self._outbox,
            poke_if_moved=self._poke_if_moved,
            closed=lambda: self._closed,
        )
        self._others = OtherWriters(shared)
        self._fetches = Fetches(tracker, self._others.handed_out)
        # IDs whose caller went away before it got them: no row, as a failed block.
        self._finisher = Finisher(shared)
        self._settler = Settler(shared, self._fetches)
        self._allocator = IdAllocator(self._fetches, store.allocate, self._finisher.finish_flushed)
        # Any-writer streams keep no position rows (R-ID-12).
        self._keeps_rows = bool(spec.writers)
        self._position_writer: PositionWriter | None = None
        if self._keeps_rows and (tracker.is_writer or follow_database):
            self._position_writer = PositionWriter(
                current=lambda: tracker.local_position,
                upsert=self._store_own_position if tracker.is_writer else None,
                # A replicated writer learns only what moves its own idle position.
                refresh=(
                    self._others.refresh_positions
                    if follow_database
                    else self._others.learn_stored_positions
                ),
                interval=position_flush_interval,
                # Writes within this window share one upsert. Database-only readers
                # poll about once per interval, so a tenth of it costs them nothing.
                delay=min(MAX_UPSERT_DELAY, position_flush_interval / 10),
                written=tracker.local_position,
                name=f"{spec.name}/{instance_name}",
                lost=lambda: db.connections_lost,
            )
        self._follow_database = follow_database
        # What the per-write helpers (`Reservation`, `InsertAtCommit`) use of this
        # generator, handed over once rather than reached for.
        self._parts = Parts(
            shared=shared,
            allocator=self._allocator,
            wal=db.wal,
            fetches=self._fetches,
            finish_durable=self._finisher.finish_durable,
            finish_flushed=self._finisher.finish_flushed,
            returned_ids=statements.returned_ids,
            lost=self._settler.lost,
            written=self._written_at_commit,
        )
        self._fencer: Fencer | None = None
        others = set(spec.writers) - {instance_name}
        if fence_after is not None and others:
            self._fencer = Fencer(
                store,
                self._all_positions,
                self._on_fenced,
                fence_after=fence_after,
                own=instance_name if tracker.is_writer else None,
            )

    @classmethod
    async def create(
        cls,
        db: Database,
        spec: StreamSpec,
        instance_name: str,
        *,
        position_flush_interval: float = 1.0,
        follow_database: bool = True,
        fence_after: float | None = None,
    ) -> MultiWriterIdGenerator:
        """Check the stream's tables and sequence, load positions, register this writer.

        `position_flush_interval` bounds how stale this writer's row in `stream_positions`
        gets while it is idle. With `follow_database` the generator also refreshes the
        other writers' positions from the database that often (needed when no
        replication feeds it); without, a writer still reads them while idle, to move
        its own position only. With `fence_after` (seconds), a writer that holds the
        stream's linear position that long without moving is fenced once none of its
        connections is alive (`Instance` sets it; writers need a `Database` connected
        with their `incarnation` to be fenceable).
        """
        if not isinstance(spec, StreamSpec):
            raise ConfigError(f"spec must be a StreamSpec, not {type(spec).__name__}")
        if not isinstance(instance_name, str) or not instance_name.strip():
            raise ConfigError(f"instance_name must be a non-empty string, not {instance_name!r}")
        if position_flush_interval <= 0:
            raise ConfigError("position_flush_interval must be positive (seconds)")
        if fence_after is not None and fence_after <= 0:
            raise ConfigError("fence_after must be positive (seconds), or None to never fence")
        store = StreamStore(db, spec)
        logger.info(
            "stream %s: starting as %s; checking tables and sequence %s",
            spec.name,
            instance_name,
            spec.sequence,
        )
        # Every step may run again (a server restart or crash meanwhile): creating the
        # sequence checks first, repairing it and registering only move forwards.
        survey, tracker = await db.retry_idempotent(
            f"start stream {spec.name} as {instance_name}",
            lambda: load(db, store, spec, instance_name),
        )
        gen = cls(
            db,
            spec,
            instance_name,
            store,
            tracker,
            position_flush_interval=position_flush_interval,
            follow_database=follow_database,
            fence_after=fence_after,
        )
        db.note_head(spec.sequence, survey.head)
        gen._start()
        logger.info(
            "stream %s: %s ready; persisted up to %d, positions %s",
            spec.name,
            instance_name,
            gen.get_persisted_upto_position(),
            gen.get_positions(),
        )
        return gen

    # -- identity ----------------------------------------------------------------------

    @property
    def spec(self) -> StreamSpec:
        return self._spec

    @property
    def stream_name(self) -> str:
        return self._spec.name

    @property
    def instance_name(self) -> str:
        return self._instance

    @property
    def backwards(self) -> bool:
        return self._spec.backwards

    @property
    def is_writer(self) -> bool:
        return self._tracker.is_writer

    @property
    def store(self) -> StreamStore:
        return self._store

    # -- allocation ----------------------------------------------------------------------

    def get_next(self) -> AbstractAsyncContextManager[int]:
        """`async with gen.get_next() as stream_id:` write rows, then the ID completes."""
        self._check_writer()
        return Reservation(self._parts, 1, self._statements.first_signed)

    def get_next_mult(self, n: int) -> AbstractAsyncContextManager[list[int]]:
        """Like `get_next`, for `n` IDs taken in one round trip."""
        self._check_writer()
        check_count(n)
        return Reservation(self._parts, n, self._statements.signed)

    async def get_next_txn(self, txn: Transaction) -> int:
        """An ID inside the caller's transaction; it completes after commit or rollback."""
        return (await self.get_next_mult_txn(txn, 1))[0]

    async def get_next_mult_txn(self, txn: Transaction, n: int) -> list[int]:
        self._check_writer()
        check_count(n)
        ids = await self._take_ids(lambda: self._store.allocate_in(txn, n))
        # Finished once the WAL is on disk past them: at once when the commit wrote
        # something (it flushed), else after a flush (see `Finisher.finish_flushed`).
        txn.call_after(lambda: self._finisher.finish_if_flushed(txn, ids))
        txn.call_on_exception(lambda: self._finisher.finish_flushed(ids))
        return self._statements.signed(ids)

    async def insert(self, query: str, params: Params = None) -> list[int]:
        """Run one statement that takes its own stream IDs, in one round trip.

        Write `{id}` wherever a new row's stream ID goes (once per row, e.g. in each
        VALUES tuple or in the SELECT list of INSERT ... SELECT), and end the statement
        with `RETURNING <id column>` so plait learns the IDs it took. The statement runs
        in autocommit mode; its IDs complete as soon as it returns. Returns the IDs.
        """
        self._check_writer()
        text = self._statements.with_ids(query)

        backend_pid: int | None = None

        async def run() -> list[int]:
            nonlocal backend_pid
            async with self._db.scalar_cursor() as cursor:
                backend_pid = server_pid(cursor.connection)
                if not self._outbox.is_open:
                    await cursor.execute(text, params)
                    return self._statements.returned_ids(
                        await cursor.fetchall() if cursor.description else None
                    )
                cursor.row_factory = tuple_row  # whole rows, for the outbox
                try:
                    await cursor.execute(text, params)
                    records = await cursor.fetchall() if cursor.description else None
                    rows = self._statements.rows_of(column_names(cursor), records)
                finally:
                    cursor.row_factory = scalar_row
            ids = self._statements.returned_ids(
                None if records is None else [r[0] for r in records]
            )
            # Before the IDs complete (when `run` returns), as for every other write.
            self._outbox.written(ids, rows)
            return ids

        # Autocommit: when the statement returns, its IDs are committed already.
        ids = await self._take_ids(
            run,
            completed=True,
            unsettled=lambda ticket, error: (
                isinstance(error, IDS_UNKNOWN) and self._settler.unsettled(ticket, backend_pid)
            ),
        )
        return self._statements.signed(ids)

    async def insert_txn(
        self,
        txn: Transaction,
        query: str,
        params: Params = None,
    ) -> list[int]:
        """Like `insert`, inside the caller's transaction: the IDs complete after it
        commits or rolls back."""
        self._check_writer()
        text = self._statements.with_ids(query)

        rows: list[StreamRow] | None = None

        async def run() -> list[int]:
            nonlocal rows
            cursor = await txn.execute(text, params)
            if cursor.description is None:
                return self._statements.returned_ids(None)
            records = await cursor.fetchall()
            if self._outbox.is_open:
                rows = self._statements.rows_of(column_names(cursor), records)
            return self._statements.returned_ids([row[0] for row in records])

        ids = await self._take_ids(run)
        self._finisher.complete_after(txn, ids, rows)
        return self._statements.signed(ids)

    def check_statement(self, query: str) -> None:
        """Raise what `insert` would for `query` before it runs: this instance is not a
        writer of the stream, or the statement does not say where IDs go."""
        self._check_writer()
        self._statements.with_ids(query)

    async def insert_many_txn(
        self, txn: Transaction, query: str, params_seq: Sequence[Params]
    ) -> list[list[int]]:
        """`insert_txn` once for each parameters of `params_seq`, in one round trip: the
        IDs each run took, in order. They complete after the transaction ends, all
        together (what `Batcher` coalesces concurrent writes into)."""
        self._check_writer()
        text = self._statements.with_ids(query)
        statements = self._statements
        per_run: list[list[int]] = []
        rows: list[StreamRow] | None = None

        async def run() -> list[int]:
            nonlocal per_run, rows
            columns, results = await txn.executemany(text, params_seq, returning=True)
            per_run = [
                statements.returned_ids(None if records is None else [r[0] for r in records])
                for records in results
            ]
            if self._outbox.is_open:
                records = [record for result in results for record in result or ()]
                rows = statements.rows_of(columns, records)
            return sorted(i for ids in per_run for i in ids)

        if not params_seq:
            return []
        ids = await self._take_ids(run)
        self._finisher.complete_after(txn, ids, rows)
        return [statements.signed(ids) for ids in per_run]

    def insert_with_commit(
        self, txn: Transaction, query: str, params: Callable[[], Params] | None = None
    ) -> None:
        """Like `insert_txn`, but the statement travels in the same round trip as the
        transaction's COMMIT, so it costs no round trip of its own (cache invalidation
        rows). `params()` is called when COMMIT is sent: rows gathered during the
        transaction go out in one statement. The IDs complete once COMMIT succeeded;
        they are not known before."""
        self._check_writer()
        txn.send_with_commit(InsertAtCommit(self._parts, self._statements.with_ids(query), params))

    async def _take_ids(
        self,
        fetch: Callable[[], Awaitable[list[int]]],
        *,
        completed: bool = False,
        unsettled: Callable[[FetchTicket, BaseException], bool] | None = None,
    ) -> list[int]:
        before = self._tracker.local_position
        try:
            return await take_ids(self._fetches, fetch, completed=completed, unsettled=unsettled)
        finally:
            # Also when it failed: its ticket's end may let the idle position move.
            self._poke_if_moved(before)

    def _poke_if_moved(self, before: int) -> None:
        """Our position moved: have the position writer store it soon, and post it to
        the outbox (replication sends the new rows)."""
        if self._tracker.local_position != before:
            if self._position_writer is not None:
                self._position_writer.poke()
            self._outbox.moved()

    @property
    def outbox(self) -> Outbox:
        """What this writer posts for replication (see `open_outbox`)."""
        return self._outbox

    def open_outbox(self, reader: Callable[[], None] | None = None) -> Outbox:
        """From now on, post everything replication needs to the outbox and keep it
        there until it is taken (`reader`, once given, is scheduled on the event loop
        after posts; see `Outbox`): each write's IDs, and its rows when the statement
        returned them whole (an `insert`/`insert_txn` with `RETURNING *` on the
        stream's one table), else that they are not known; ranges a write whose outcome
        was lost may hold; position moves; and fences of dead writers, which the
        generator then no longer advances itself (replication catches their rows up
        first). Call it before the first write. A generator that does not follow the
        database starts fencing only now: before, nothing would deliver the rows."""
        self._outbox.open(reader)
        if self._fencer is not None and not self._fencer.started and not self._closed:
            self._fencer.start()
        return self._outbox

    def _written_at_commit(
        self, ids: list[int], columns: list[str] | None, records: list[TupleRow] | None
    ) -> None:
        """A statement sent with COMMIT wrote `ids`: its rows, when it returned them
        whole, go to the outbox with the IDs."""
        if self._outbox.is_open:
            self._outbox.written(ids, self._statements.rows_of(columns, records))

    def _check_writer(self) -> None:
        if self._closed:
            raise StateError(f"generator for stream {self._spec.name!r} is closed")
        if not self._tracker.is_writer:
            raise NotAWriterError(
                f"instance {self._instance!r} is not a writer of stream {self._spec.name!r} "
                f"(its writers are {list(self._spec.writers)}); allocate from one of those "
                "instances, or add this one to the stream's writers"
            )

    # -- positions -------------------------------------------------------------------------

    def get_current_token(self) -> int:
        """Persisted-up-to: every ID at or below it has completed, on every writer."""
        return self._sign * self._tracker.persisted_upto

    def get_persisted_upto_position(self) -> int:
        """The same as `get_current_token` (the names of the reference API)."""
        return self.get_current_token()

    def get_current_token_for_writer(self, instance_name: str) -> int:
        """A safe position for one writer (for this instance: idle-advanced)."""
        return self._sign * self._tracker.position_of(instance_name)

    def get_minimal_local_current_token(self) -> int:
        """This writer's position from its own completed writes only."""
        return self._sign * self._tracker.last_local_write

    def get_last_completed_token(self) -> int:
        """The largest ID this writer has completed, although smaller ones may still be
        running: what another process must have seen of this writer to see every write
        that returned here (read-your-writes)."""
        return self._sign * self._tracker.last_completed

    def get_positions(self) -> dict[str, int]:
        return {w: self._sign * p for w, p in self._tracker.positions().items()}

    def oldest_unfinished_age(self) -> float | None:
        """Seconds since this writer took the ID that holds its position (the lowest
        it has not finished, or a fetch of IDs still in flight); None when nothing is
        pending. A long one is a transaction left open, or a statement stuck."""
        if not self._tracker.is_writer:
            return None
        began = self._fetches.oldest_began()
        return None if began is None else max(0.0, time.monotonic() - began)

    def advance(self, instance_name: str, position: int) -> None:
        """Another writer reached `position` (signed); never moves anything backwards.
        A writer takes a position above the largest ID it knows handed out only once
        the sequence confirms it (`OtherWriters.advance`); a reader takes it as given."""
        self._others.advance(instance_name, position)

    def vouched(self, instance_name: str, position: int) -> None:
        """`advance`, for a position replication vouches for (`OtherWriters.vouched`)."""
        self._others.vouched(instance_name, position)

    def heard(self, instance_name: str, position: int) -> None:
        """A position of another writer heard before this process handled the rows
        before it: it moves only this writer's own idle position (R-ID-5;
        `OtherWriters.heard`)."""
        self._others.heard(instance_name, position)

    async def get_max_allocated_token(self) -> int:
        """The largest ID the sequence has handed out (signed)."""
        return await self._others.get_max_allocated_token()

    def is_known_allocated(self, position: int) -> bool:
        """Whether `position` (signed) is known, without a query, to name an ID the
        sequence handed out; False says only "not known yet": ask `is_allocated`."""
        return self._others.is_known_allocated(position)

    async def is_allocated(self, position: int) -> bool:
        """Whether the sequence has handed out `position` (signed): a position above
        the head names no ID and is never to be adopted, stored or waited on (R-ID-14)."""
        return await self._others.is_allocated(position)

    async def is_stored_at(self, writer: str, position: int) -> bool:
        """Whether `writer`'s stored position is at or past `position` (signed): a
        fence another instance announces is a fact once this holds (R-ID-14)."""
        return await self._others.is_stored_at(writer, position)

    async def refresh_positions(self) -> None:
        """Learn the other writers' positions from `stream_positions`."""
        await self._others.refresh_positions()

    async def flush_position(self) -> None:
        """Store this writer's current position now (it is otherwise stored in the
        background after each write and every `position_flush_interval`)."""
        if self._position_writer is not None and self._tracker.is_writer:
            await self._position_writer.flush()

    # -- reading ---------------------------------------------------------------------------

    async def get_updates_since(
        self,
        writer: str | None,
        from_exclusive: int,
        to_inclusive: int,
        limit: int = DEFAULT_BATCH,
    ) -> tuple[list[StreamRow], int, bool]:
        """Rows with IDs in (from, to] of one writer (or of all with `writer=None`).

        Returns (rows sorted by ID, upto, limited). When limited, every row with ID <= upto
        is included and reading on from upto skips nothing.
        """
        check_count(limit)
        low, high = self._sign * from_exclusive, self._sign * to_inclusive
        if high <= low:
            return [], to_inclusive, False
        page = await self._store.rows.read_page(writer, low, high, limit)
        return page.rows, self._sign * page.upto, page.limited

    # -- lifetime ----------------------------------------------------------------------------

    def _pending(self) -> bool:
        # IDs handed to the caller and not finished. A fetch in flight is no danger: if
        # its connection died, its IDs reach nobody; and a new write's own fetch is in
        # flight while it waits for the connection that renews.
        return self._tracker.holds_ids

    def _start(self) -> None:
        if self._tracker.is_writer:
            self._db.hold_renewal(self._pending)
        if self._position_writer is not None:
            self._position_writer.start()
        if self._fencer is not None and self._follow_database:
            self._fencer.start()  # else once replication drains the outbox (`open_outbox`)
        self._db.on_close(self.close)

    # -- fencing ---------------------------------------------------------------------------

    @property
    def fences(self) -> int:
        """How many times this instance fenced a writer forward."""
        return 0 if self._fencer is None else self._fencer.fences

    def _all_positions(self) -> dict[str, int]:
        """Every writer's position (internal), this one's idle-advanced: what a fence
        may move a dead writer up to is the highest of them, a completed ID."""
        tracker = self._tracker
        positions = tracker.positions()
        if tracker.is_writer:
            positions[self._instance] = tracker.local_position
        return positions

    def _on_fenced(self, writer: str, position: int) -> None:
        # A fence moves a writer to a completed ID at or below the head it read.
        self._db.note_head(self._spec.sequence, position)
        signed = self._sign * position
        if self._outbox.is_open:
            self._outbox.fenced(writer, signed)  # replication catches its rows up first
        else:
            self.advance(writer, signed)

    async def _store_own_position(self, position: int, durable: bool) -> None:
        # Routine stores commit asynchronously; durable ones: see `PositionWriter`.
        await self._store.upsert_position(self._instance, position, durable=durable)

    async def close(self) -> None:
        """Stop background work and store the final position."""
        if self._closed:
            return
        self._closed = True
        self._db.forget_on_close(self.close)
        self._db.release_renewal(self._pending)
        await self._settler.close()
        await self._finisher.close()
        await self._others.close()
        if self._fencer is not None:
            await self._fencer.stop()
        await self._allocator.close()
        if self._position_writer is not None:
            await self._position_writer.stop(final_flush=self._tracker.is_writer)

    async def __aenter__(self) -> MultiWriterIdGenerator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
