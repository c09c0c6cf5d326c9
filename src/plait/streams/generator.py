"""`MultiWriterIdGenerator`: allocate stream IDs on one writer and follow every writer.

This wires small parts together: a `PositionTracker` (pure position logic), a
`StreamStore` (all SQL), an `IdAllocator` (shared round trips) and a `PositionWriter`
(the background upserts of this writer's row). Public values are signed: a backwards
stream shows negative IDs and positions, and `advance` takes them that way too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import psycopg
from psycopg.rows import TupleRow, scalar_row, tuple_row

from plait.core.positions import FetchTicket, PositionTracker
from plait.core.spec import StreamSpec
from plait.core.throttle import Throttle
from plait.errors import (
    ConfigError,
    NotAWriterError,
    PlaitError,
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
from plait.streams.outbox import Outbox
from plait.streams.position_writer import PositionWriter
from plait.streams.startup import load, observe_committed
from plait.streams.write_helpers import (
    IDS_UNKNOWN,
    IdsNotReturned,
    InsertAtCommit,
    Parts,
    Reservation,
    check_count,
    column_names,
)
from plait.tasks import cancel_and_wait

logger = logging.getLogger(__name__)
T = TypeVar("T")


DEFAULT_BATCH = 100
MAX_UPSERT_DELAY = 0.1  # seconds
# Statements given to `insert` are rewritten once and kept (applications use a handful).
SQL_CACHE_SIZE = 256
# IDs read per query when a database-only reader passes committed rows (the IDs between
# a slow writer's position and its pending ID are few; a gapless run goes on page by page).
PASS_PAGE = 1000


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
        self._insert_sql: dict[str, str] = {}
        self._fetches = Fetches(tracker, self._handed_out)
        # Everything replication hears of this writer goes through here (`open_outbox`).
        self._outbox = Outbox(spec.sign)
        self._closed = False
        # IDs whose caller went away before it got them: no row, as a failed block.
        self._finisher = Finisher(
            name=spec.name,
            db=db,
            store=store,
            tracker=tracker,
            outbox=self._outbox,
            poke_if_moved=self._poke_if_moved,
            closed=lambda: self._closed,
        )
        self._settler = Settler(
            name=spec.name,
            db=db,
            store=store,
            tracker=tracker,
            fetches=self._fetches,
            outbox=self._outbox,
            poke_if_moved=self._poke_if_moved,
        )
        self._allocator = IdAllocator(self._fetches, store.allocate, self._finisher.finish_flushed)
        # Any-writer streams keep no position rows (R-ID-12).
        self._keeps_rows = bool(spec.writers)
        self._position_writer: PositionWriter | None = None
        if self._keeps_rows and (tracker.is_writer or follow_database):
            self._position_writer = PositionWriter(
                current=lambda: tracker.local_position,
                upsert=self._store_own_position if tracker.is_writer else None,
                # A replicated writer learns only what moves its own idle position.
                refresh=self.refresh_positions if follow_database else self._learn_stored_positions,
                interval=position_flush_interval,
                # Writes within this window share one upsert. Database-only readers
                # poll about once per interval, so a tenth of it costs them nothing.
                delay=min(MAX_UPSERT_DELAY, position_flush_interval / 10),
                written=tracker.local_position,
                name=f"{spec.name}/{instance_name}",
                lost=lambda: db.connections_lost,
            )
        self._follow_database = follow_database
        self._heard_upto = tracker.max_seen  # when _learn_stored_positions last looked
        self._passed_from = tracker.persisted_upto  # when _pass_committed_rows last looked
        # What the sequence is known to have handed out is `db.known_head` (`create`
        # notes the head it read). Another process's claim above it counts only once
        # the sequence confirms it (R-ID-14).
        self._head_lock = asyncio.Lock()
        # The highest stored position read per writer (`is_stored_at`; internal).
        self._stored_at_least: dict[str, int] = {}
        # Positions given to `advance` that a writer must check against the sequence
        # before it takes them (the largest per writer), and the task that checks.
        self._unconfirmed: dict[str, int] = {}
        self._confirming: asyncio.Task[None] | None = None
        self._refused_advances = Throttle(10.0)  # one warning per writer this often
        # What the per-write helpers (`Reservation`, `InsertAtCommit`) use of this
        # generator, handed over once rather than reached for.
        self._parts = Parts(
            stream_name=spec.name,
            allocator=self._allocator,
            store=store,
            wal=db.wal,
            tracker=tracker,
            fetches=self._fetches,
            finish_durable=self._finisher.finish_durable,
            finish_flushed=self._finisher.finish_flushed,
            returned_ids=self._returned_ids,
            lost=self._settler.lost,
            written=self._written_at_commit,
            poke_if_moved=self._poke_if_moved,
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
        return Reservation(self._parts, 1, self._first_signed)

    def get_next_mult(self, n: int) -> AbstractAsyncContextManager[list[int]]:
        """Like `get_next`, for `n` IDs taken in one round trip."""
        self._check_writer()
        check_count(n)
        return Reservation(self._parts, n, self._signed)

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
        return self._signed(ids)

    async def insert(self, query: str, params: Params = None) -> list[int]:
        """Run one statement that takes its own stream IDs, in one round trip.

        Write `{id}` wherever a new row's stream ID goes (once per row, e.g. in each
        VALUES tuple or in the SELECT list of INSERT ... SELECT), and end the statement
        with `RETURNING <id column>` so plait learns the IDs it took. The statement runs
        in autocommit mode; its IDs complete as soon as it returns. Returns the IDs.
        """
        self._check_writer()
        text = self._with_ids(query)

        backend_pid: int | None = None

        async def run() -> list[int]:
            nonlocal backend_pid
            async with self._db.scalar_cursor() as cursor:
                backend_pid = server_pid(cursor.connection)
                if not self._outbox.is_open:
                    await cursor.execute(text, params)
                    return self._returned_ids(
                        await cursor.fetchall() if cursor.description else None
                    )
                cursor.row_factory = tuple_row  # whole rows, for the outbox
                try:
                    await cursor.execute(text, params)
                    records = await cursor.fetchall() if cursor.description else None
                    rows = self._rows_of(column_names(cursor), records)
                finally:
                    cursor.row_factory = scalar_row
            ids = self._returned_ids(None if records is None else [r[0] for r in records])
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
        return self._signed(ids)

    async def insert_txn(
        self,
        txn: Transaction,
        query: str,
        params: Params = None,
    ) -> list[int]:
        """Like `insert`, inside the caller's transaction: the IDs complete after it
        commits or rolls back."""
        self._check_writer()
        text = self._with_ids(query)

        rows: list[StreamRow] | None = None

        async def run() -> list[int]:
            nonlocal rows
            cursor = await txn.execute(text, params)
            if cursor.description is None:
                return self._returned_ids(None)
            records = await cursor.fetchall()
            if self._outbox.is_open:
                rows = self._rows_of(column_names(cursor), records)
            return self._returned_ids([row[0] for row in records])

        ids = await self._take_ids(run)
        self._finisher.complete_after(txn, ids, rows)
        return self._signed(ids)

    def insert_with_commit(
        self, txn: Transaction, query: str, params: Callable[[], Params] | None = None
    ) -> None:
        """Like `insert_txn`, but the statement travels in the same round trip as the
        transaction's COMMIT, so it costs no round trip of its own (cache invalidation
        rows). `params()` is called when COMMIT is sent: rows gathered during the
        transaction go out in one statement. The IDs complete once COMMIT succeeded;
        they are not known before."""
        self._check_writer()
        txn.send_with_commit(InsertAtCommit(self._parts, self._with_ids(query), params))

    async def _take_ids(
        self,
        fetch: Callable[[], Awaitable[list[int]]],
        *,
        completed: bool = False,
        unsettled: Callable[[FetchTicket, BaseException], bool] | None = None,
    ) -> list[int]:
        before = self._tracker.local_position
        ids = await take_ids(self._fetches, fetch, completed=completed, unsettled=unsettled)
        self._poke_if_moved(before)
        return ids

    def _poke_if_moved(self, before: int) -> None:
        """Our position moved: have the position writer store it soon, and post it to
        the outbox (replication sends the new rows)."""
        if self._tracker.local_position != before:
            if self._position_writer is not None:
                self._position_writer.poke()
            self._outbox.moved()

    def _idle_moved(self, before: int) -> None:
        """Our position moved by the idle rule (R-ID-5), with no write of ours: it is
        stored and announced on their own schedules, not once per position heard."""
        if self._tracker.local_position != before:
            self._outbox.idled()

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

    def _signed(self, ids: list[int]) -> list[int]:
        """Internal IDs as the caller sees them (negative on a backwards stream), in a
        list of the caller's own: completions still hold the internal one."""
        return ids.copy() if self._sign == 1 else [-i for i in ids]

    def _with_ids(self, query: str) -> str:
        cached = self._insert_sql.get(query) if isinstance(query, str) else None
        if cached is not None:
            return cached
        if not isinstance(query, str) or "{id}" not in query:
            raise ConfigError(
                "the statement must say where stream IDs go: write {id} in place of each "
                "new row's ID, e.g. INSERT INTO t (stream_id, ...) VALUES ({id}, ...) "
                "RETURNING stream_id"
            )
        if len(self._insert_sql) >= SQL_CACHE_SIZE:
            self._insert_sql.clear()  # statements built on the fly: keep memory bounded
        text = self._insert_sql[query] = query.replace("{id}", self._store.next_id_sql())
        return text

    def _returned_ids(self, values: list[Any] | None) -> list[int]:
        """The IDs a statement returned (its first column), internal domain, sorted."""
        if values is None:
            raise IdsNotReturned(
                "the statement returned nothing: end it with RETURNING <id column> so "
                "plait learns which stream IDs it took"
            )
        # One column has one type, so the first value tells; `type(...) is int` also
        # refuses bool, a subclass of int.
        if values and (type(values[0]) is not int or None in values):
            raise IdsNotReturned(
                "the statement must return the new stream IDs as its first column "
                "(RETURNING <id column>)"
            )
        if self._sign != 1:
            values = [-v for v in values]
        values.sort()
        return values

    def _first_signed(self, ids: list[int]) -> int:
        return self._sign * ids[0]

    def _written_at_commit(
        self, ids: list[int], columns: list[str] | None, records: list[TupleRow] | None
    ) -> None:
        """A statement sent with COMMIT wrote `ids`: its rows, when it returned them
        whole, go to the outbox with the IDs."""
        if self._outbox.is_open:
            self._outbox.written(ids, self._rows_of(columns, records))

    def _rows_of(
        self, columns: list[str] | None, records: list[Any] | None
    ) -> list[StreamRow] | None:
        """The rows a statement returned, when they are whole rows of the stream's one
        table (RETURNING *); else None."""
        if records is None or columns is None:
            return None
        build = self._store.row_builder(columns)
        return None if build is None else build(records)

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
        the sequence confirms it (a moment later; one the sequence has not handed out
        is refused with a warning): it would otherwise report it as its own, and
        refuse its own next IDs. A reader takes it as given."""
        if isinstance(position, bool) or not isinstance(position, int):
            raise ConfigError(f"position must be an int, not {position!r}")
        internal = self._sign * position
        if internal < 1:
            raise ConfigError(
                f"position {position} of {instance_name!r} is not a valid position of "
                f"{'a backwards' if self.backwards else 'a'} stream"
            )
        if not self._configured(instance_name):
            return
        if self._tracker.is_writer and internal > self._known_head():
            # A writer that took an ID the sequence has not handed out would report it
            # as its own position (the idle rule), store it, and refuse its own next
            # IDs as "the sequence went backwards". Replication vouches for what it
            # passes on (`vouched`); a direct call is checked here, and the position
            # taken once the sequence has handed it out (R-ID-14).
            self._confirm_later(instance_name, internal)
            return
        before = self._tracker.local_position
        self._tracker.advance(instance_name, internal)
        self._idle_moved(before)

    def vouched(self, instance_name: str, position: int) -> None:
        """`advance`, for a position replication vouches for: checked against the
        sequence on an unauthenticated link, or an authenticated writer's word about
        its own IDs. Taken at once: asking the sequence about every position of the
        other writers would cost a query per position while they write."""
        if self._configured(instance_name):
            internal = self._sign * position
            # Handed out, as far as this process knows: a crash may not take the
            # sequence back below it (`Database.known_head`).
            # A writer checks it soon after a restart (it allocates; readers need not).
            self._db.note_head(self._spec.sequence, internal, heard=self._tracker.is_writer)
            before = self._tracker.local_position
            self._tracker.advance(instance_name, internal)
            self._idle_moved(before)

    def heard(self, instance_name: str, position: int) -> None:
        """A position of another writer, vouched for as in `vouched`, heard before
        this process handled the rows before it: it moves this writer's own position
        while idle (`PositionTracker.learn_completed`), and nothing else. A writer
        whose listeners (or catch-ups) lag behind what it hears then still follows the
        others, or every reader's linear position would lag with it (R-ID-5). Like
        `vouched`, it pokes nothing: the idle move goes to the outbox (`idled`), and is
        stored and announced on their own schedules (once per interval), not once per
        token heard."""
        internal = self._sign * position
        tracker = self._tracker
        if internal <= tracker.max_seen or not tracker.is_writer:
            return  # no news, or no position of its own
        if not self._configured(instance_name):
            return
        self._db.note_head(self._spec.sequence, internal, heard=True)
        before = tracker.local_position
        tracker.learn_completed(internal)
        self._idle_moved(before)

    def _configured(self, writer: str) -> bool:
        """Whether `writer`'s positions count here. The configured writers are
        authoritative (start-up drops the rows of others too): a late message from a
        removed writer must not hold the linear position back forever."""
        if not self._spec.writers or writer in self._spec.writers:
            return True
        logger.debug(
            "stream %s: ignoring position of %r, not a configured writer", self._spec.name, writer
        )
        return False

    def _confirm_later(self, writer: str, position: int) -> None:
        if position <= self._unconfirmed.get(writer, 0) or self._closed:
            return
        self._unconfirmed[writer] = position
        if self._confirming is None or self._confirming.done():
            self._confirming = asyncio.get_running_loop().create_task(
                self._confirm_positions(), name=f"plait-confirm-{self._spec.name}"
            )

    async def _confirm_positions(self) -> None:
        """Take the positions `advance` was given above the known head once the
        sequence confirms them; refuse (and say so) the ones it has not handed out."""
        while self._unconfirmed:
            writer, position = self._unconfirmed.popitem()
            try:
                allocated = await self.is_allocated(self._sign * position)
            except (psycopg.Error, PlaitError) as err:
                logger.warning(
                    "stream %s: could not check %s's position %d against the sequence "
                    "(%s); not taking it (a later one will be)",
                    self._spec.name,
                    writer,
                    self._sign * position,
                    err,
                )
                continue
            if allocated:
                before = self._tracker.local_position
                self._tracker.advance(writer, position)
                self._poke_if_moved(before)
            elif (held := self._refused_advances.allow(writer, time.monotonic())) is not None:
                logger.warning(
                    "stream %s: not taking position %d of %s given to advance(): sequence "
                    "%s has handed out IDs up to %d only, so it names no ID (a wrong, "
                    "forged or corrupted position); %s goes on at %d%s",
                    self._spec.name,
                    self._sign * position,
                    writer,
                    self._spec.sequence,
                    self._sign * self._known_head(),
                    self._instance,
                    self.get_current_token_for_writer(self._instance),
                    f"; {held} more refused since the last warning" if held else "",
                )

    def _known_head(self) -> int:
        return self._db.known_head(self._spec.sequence)

    def _handed_out(self, stream_id: int) -> None:
        """This writer took IDs up to `stream_id` (internal) from the sequence."""
        self._db.note_head(self._spec.sequence, stream_id)

    async def get_max_allocated_token(self) -> int:
        """The largest ID the sequence has handed out (signed)."""
        head = await self._store.sequence_head()
        self._db.note_head(self._spec.sequence, head)
        return self._sign * head

    def is_known_allocated(self, position: int) -> bool:
        """Whether `position` (signed) is at or below the largest ID this process knows
        the sequence handed out; no query. False says only "not known yet": ask
        `is_allocated`."""
        return self._sign * position <= self._known_head()

    async def is_allocated(self, position: int) -> bool:
        """Whether the sequence has handed out `position` (signed). A position above
        the head names no ID and is never to be adopted, stored or waited on (R-ID-14).
        Reads the head only when the one known is below `position`; callers that ask
        meanwhile share that read."""
        internal = self._sign * position
        if internal <= self._known_head():
            return True
        async with self._head_lock:
            if internal > self._known_head():
                self._db.note_head(self._spec.sequence, await self._store.sequence_head())
        return internal <= self._known_head()

    async def is_stored_at(self, writer: str, position: int) -> bool:
        """Whether `writer`'s position in `stream_positions` is at or past `position`
        (signed): written there by the writer itself or by a fence that proved it dead,
        so a fence another instance announces is a fact once this holds (R-ID-14)."""
        internal = self._sign * position
        if internal > self._stored_at_least.get(writer, 0):
            # Stored positions only grow (and never pass the head): read once per claim
            # above the highest read.
            for name, stored in (await self._store.load_positions(drop_others=False)).items():
                self._stored_at_least[name] = max(self._stored_at_least.get(name, 0), stored)
        return internal <= self._stored_at_least.get(writer, 0)

    async def refresh_positions(self) -> None:
        """Learn the other writers' positions from `stream_positions`."""
        if not self._keeps_rows:
            return
        # Only configured writers' rows come back; our own is ignored by the tracker.
        # Stored positions are at or below the head (`StreamStore.upsert_position`).
        before = self._tracker.local_position
        for writer, position in (await self._store.load_positions(drop_others=False)).items():
            self._db.note_head(self._spec.sequence, position)
            self._tracker.advance(writer, position)
        await self._pass_committed_rows()
        self._idle_moved(before)

    async def _pass_committed_rows(self) -> None:
        """Move persisted-up-to over committed rows above it that leave no gap (R-ID-4).

        A writer whose ID waits in a long transaction stands at its last finished ID,
        while the others commit IDs between that and its pending one. A reader fed by
        replication passes those as their rows arrive; one that follows the database
        learns no IDs from rows, so it reads them, once persisted-up-to stood still for
        a whole refresh with a writer past it (no query while positions move)."""
        tracker = self._tracker
        persisted = tracker.persisted_upto
        stood_still, self._passed_from = persisted == self._passed_from, persisted
        if not stood_still or max(tracker.positions().values(), default=0) <= persisted:
            return
        first = await self._store.rows.ids_above(persisted, PASS_PAGE)
        await observe_committed(self._store, tracker, first, PASS_PAGE)
        self._passed_from = tracker.persisted_upto

    async def _learn_stored_positions(self) -> None:
        """A replicated writer, while idle: the others' stored positions move its own
        (`PositionTracker.learn_completed`). Replication moves it as soon as it hears
        the others; this keeps it moving while it hears nothing (Redis down, or out of
        its reach), or readers of the database alone would stall on it (R-ID-8)."""
        tracker = self._tracker
        heard, self._heard_upto = self._heard_upto, tracker.max_seen
        if not tracker.is_idle or tracker.max_seen > heard:
            return  # busy, or replication moved it since the last look: no query
        stored = await self._store.load_positions(drop_others=False)
        others = [position for writer, position in stored.items() if writer != self._instance]
        if others:
            before = tracker.local_position
            tracker.learn_completed(max(others))
            self._heard_upto = tracker.max_seen  # what it learned here is no news next time
            self._poke_if_moved(before)

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
        if self._confirming is not None:
            await cancel_and_wait(self._confirming)
        if self._fencer is not None:
            await self._fencer.stop()
        await self._allocator.close()
        if self._position_writer is not None:
            await self._position_writer.stop(final_flush=self._tracker.is_writer)

    async def __aenter__(self) -> MultiWriterIdGenerator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
