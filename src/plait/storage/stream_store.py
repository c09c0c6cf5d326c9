"""The SQL about one stream: its sequence, its rows in `stream_positions`, and the
start-up survey; registrations and fences are `writer_rows.py` (`writers`), reads of
its rows `stream_rows.py` (`rows`), each table's queries `stream_tables.py`, the
tables' start-up check `table_checks.py`, the spec's row `recorded.py`.

Values cross these modules' boundary in the *internal* domain (always growing); a
backwards stream's stored IDs and positions are negated in them and nowhere else. Reads
that look for rows by ID go through the required (instance, id) index one writer at a
time (a loose index scan), so start-up never scans a whole table.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import AsyncConnection, AsyncCursor, sql
from psycopg.rows import TupleRow

from plait.core.spec import StreamSpec
from plait.errors import (
    DatabaseUnavailableError,
    PlaitError,
    PositionAboveHeadError,
    SequenceBehindError,
)
from plait.storage.database import Database
from plait.storage.identity import regclass_text
from plait.storage.recorded import head_of, head_query, ident, record_spec_statement
from plait.storage.stream_rows import StreamRows
from plait.storage.stream_tables import StreamRow, StreamTable
from plait.storage.table_checks import check_tables
from plait.storage.transaction import Transaction
from plait.storage.writer_rows import WriterRows

logger = logging.getLogger(__name__)

# IDs read per table and query while looking for rows above the loaded positions.
STARTUP_PAGE = 10_000


@dataclass(frozen=True, slots=True)
class Survey:
    """What start-up reads in one round trip (internal domain).

    `positions` are the configured writers' rows in `stream_positions`; `ids`, `cutoff`,
    `more` and `own_max` are `ids_above` for the lowest of them (empty without positions).
    """

    table_max: int | None
    head: int
    top_position: tuple[str, int] | None
    positions: dict[str, int]
    ids: list[int]
    cutoff: int
    more: bool
    own_max: int | None


class StreamStore:
    """The database side of one stream, for `MultiWriterIdGenerator` and readers."""

    def __init__(self, db: Database, spec: StreamSpec) -> None:
        self.db = db
        self.spec = spec
        self._sign = spec.sign
        self._seq = ident(spec.sequence)
        self._seq_regclass = regclass_text(spec.sequence)
        self._head_query = head_query(spec.sequence)
        self._tables = [StreamTable(t, spec.backwards) for t in spec.tables]
        # Its rows: read at start-up, by range, and scanned for catch-up.
        self.rows = StreamRows(db, spec, self._tables)
        # Its writers' rows in stream_positions: registrations and fences.
        self.writers = WriterRows(db, spec, self._tables, self._head_query, self.allocate_in)
        self._row_builders: dict[
            tuple[str, ...], Callable[[list[tuple[Any, ...]]], list[StreamRow]] | None
        ] = {}
        # Where PostgreSQL's WAL stood just after the latest `allocate` (an LSN in bytes;
        # how far it is on disk: `Database.wal`).
        self.allocated_lsn = 0
        self._durable = asyncio.Lock()  # one check or flush at a time serves the others
        # Statements `make_durable` sent; the last failure, and which of them it was.
        self._durable_tries = 0
        self._durable_failure: BaseException | None = None
        self._durable_failed_at = 0

    # -- start-up checks ------------------------------------------------------------------

    async def check_tables(self) -> bool:
        """Every table and column exists with a usable type; warn about a missing index
        (`table_checks.check_tables`). Returns whether the sequence exists already."""
        return await check_tables(self.db, self.spec, self._tables)

    def row_builder(
        self, names: list[str]
    ) -> Callable[[list[tuple[Any, ...]]], list[StreamRow]] | None:
        """How to make `StreamRow`s of tuples with these columns, when they are whole
        rows of this stream's one table; None otherwise."""
        key = tuple(names)
        if key in self._row_builders:  # one per statement shape: inserts repeat
            return self._row_builders[key]
        build = None
        table = self._tables[0]
        if (
            len(self._tables) == 1
            and table.columns
            and set(names) == table.columns
            and len(names) == len(table.columns)
        ):
            build = StreamRows.stream_rows(table)(table.name, [(name, 0) for name in names])
        if len(self._row_builders) >= 64:
            self._row_builders.clear()
        self._row_builders[key] = build
        return build

    async def ensure_sequence(self) -> bool:
        """Create the sequence if missing, then take ID 1 so the first real ID is 2.

        Writers starting together all find it missing; a session-level lock lets one
        create it. The check runs in a transaction begun *after* the lock was granted:
        a backend that looked the name up before keeps that (negative) answer cached
        until its next transaction starts, and would try to create it again.
        """
        key = self._lock_key()
        async with self.db.connection() as conn:
            await conn.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (key,))
            try:
                async with conn.transaction():
                    cur = await conn.execute("SELECT to_regclass(%s)", (self._seq_regclass,))
                    row = await cur.fetchone()
                    if row is not None and row[0] is not None:
                        return False
                    logger.info(
                        "creating sequence %s for stream %s", self.spec.sequence, self.spec.name
                    )
                    await conn.execute(sql.SQL("CREATE SEQUENCE {}").format(self._seq))
                    await conn.execute("SELECT nextval(%s::regclass)", (self._seq_regclass,))
                    return True
            finally:
                await conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (key,))

    def _lock_key(self) -> str:
        return f"plait:sequence:{self.spec.sequence}"

    async def _lock_sequence(self, conn: AsyncConnection[TupleRow]) -> None:
        """Serialise creating and repairing this sequence across processes (until the
        transaction ends)."""
        await conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (self._lock_key(),)
        )

    async def flush_wal(self) -> None:
        """Return once everything the server logged so far is on disk. What it is for:
        the sequence's log record of IDs whose transaction rolled back (R-ID-14,
        `Finisher.finish_flushed`).

        A commit waits for the WAL up to its own record only when the transaction wrote
        some: an xid alone is not enough. Locking the stream's row in plait_streams
        writes a lock record and changes nothing, and every writer may (start-up writes
        that row; its upsert's lock does not conflict). `local`: the crash this is for
        is this server's; a standby that is down must not hold writers' positions."""
        async with self.db.scalar_cursor() as cur:
            await cur.execute(
                "SELECT set_config('synchronous_commit', 'local', true) FROM plait_streams"
                " WHERE stream_name = %s FOR KEY SHARE",
                (self.spec.name,),
            )
            locked = await cur.fetchone()
        if locked is None:  # the row is gone: write it again, which flushes as well
            async with self.db.connection() as conn:
                await conn.execute(*record_spec_statement(self.spec))

    async def sequence_head(self) -> int:
        """The largest ID the sequence has handed out."""
        async with self.db.connection() as conn:
            row = await (await conn.execute(self._head_query)).fetchone()
        assert row is not None
        return head_of(row)

    async def survey(self, own: str | None) -> Survey:
        """Everything start-up reads, in one pipelined round trip (R-ID-9, R-ST-4).

        In one transaction: records the spec, reads the tables' largest IDs, the sequence
        head, the highest position row, deletes the rows of writers no longer configured,
        reads the rest, and reads the IDs above the lowest of them (and `own`'s largest ID
        above its own row): the server computes that floor, so no second round trip
        waits for it.
        """
        writers = list(self.spec.writers)
        # The lowest configured position, stored form (backwards: the largest value).
        floor = sql.SQL(
            "(SELECT {agg}(stream_id) FROM stream_positions"
            " WHERE stream_name = %(stream)s AND instance_name = ANY(%(writers)s))"
        ).format(agg=sql.SQL("MAX" if self.spec.backwards else "MIN"))
        own_floor = sql.SQL(
            "COALESCE((SELECT stream_id FROM stream_positions"
            " WHERE stream_name = %(stream)s AND instance_name = %(inst)s), {floor})"
        ).format(floor=floor)
        names = {"stream": self.spec.name, "writers": writers, "inst": own, "n": STARTUP_PAGE}
        async with self.db.connection() as conn:
            async with conn.pipeline():
                # BEGIN and COMMIT as plain statements: psycopg's transaction() would
                # sync the pipeline, a round trip each. The floor is unknown when these
                # are planned, so the estimates are large enough to trigger JIT
                # compilation: milliseconds for microseconds of work.
                await conn.execute("BEGIN")
                await conn.execute("SET LOCAL jit = off")
                await conn.execute(*record_spec_statement(self.spec))
                maxima = [await conn.execute(t.max_query()) for t in self._tables]
                head = await conn.execute(self._head_query)
                top = None
                if not self.spec.any_writer:
                    top = await conn.execute(
                        "SELECT instance_name, stream_id FROM stream_positions"
                        " WHERE stream_name = %s ORDER BY stream_id "
                        + ("ASC" if self.spec.backwards else "DESC")
                        + " LIMIT 1",
                        (self.spec.name,),
                    )
                positions = pages = None
                owns = []
                if writers:
                    positions = await self._load_positions_in(conn, drop_others=True)
                    pages = [
                        await conn.execute(t.ids_above_query(floor), names) for t in self._tables
                    ]
                    if own is not None:
                        owns = [
                            await conn.execute(t.own_max_above_query(own_floor), names)
                            for t in self._tables
                        ]
                # A failure above ends the pipeline with the transaction aborted; the
                # connection then goes back to the pool, which rolls it back.
                await conn.execute("COMMIT")
            table_max = await self._largest(maxima)
            head_row = await head.fetchone()
            assert head_row is not None
            top_row = await top.fetchone() if top is not None else None
            loaded = await self._positions_from(positions) if positions is not None else {}
            lowest = min(loaded.values(), default=0)
            ids, cutoff, more = (
                await self.rows.ids_from(pages, lowest, STARTUP_PAGE)
                if pages is not None and loaded
                else ([], lowest, False)
            )
            own_max = await self._largest(owns) if loaded else None
        return Survey(
            table_max=table_max,
            head=head_of(head_row),
            top_position=None if top_row is None else (top_row[0], self._sign * int(top_row[1])),
            positions=loaded,
            ids=ids,
            cutoff=cutoff,
            more=more,
            own_max=own_max,
        )

    async def check_sequence(self, survey: Survey) -> None:
        """R-ST-4: move a lagging sequence up; refuse when positions are ahead of it."""
        head, table_max = survey.head, survey.table_max
        if table_max is not None and table_max > head:
            logger.warning(
                "stream %s: sequence %s is at %d but its tables hold ID %d; moving the "
                "sequence up to %d so no ID is handed out twice",
                self.spec.name,
                self.spec.sequence,
                head,
                table_max,
                table_max,
            )
            async with self.db.connection() as conn, conn.transaction():
                await self._lock_sequence(conn)
                await conn.execute(
                    sql.SQL(
                        "SELECT setval(%s::regclass, %s) WHERE (SELECT last_value FROM {}) < %s"
                    ).format(self._seq),
                    (self._seq_regclass, table_max, table_max),
                )
            head = await self.sequence_head()
        top = survey.top_position
        if top is not None and top[1] > head:
            raise SequenceBehindError(
                f"stream {self.spec.name!r}: stream_positions records writer {top[0]!r} at "
                f"{self._sign * top[1]}, but sequence {self.spec.sequence!r} has only handed "
                f"out up to {self._sign * head}. The sequence was reset or restored from an "
                "older backup, and allocating now would reuse IDs. To recover: stop every "
                "writer of the stream, run DELETE FROM stream_positions WHERE stream_name = "
                f"'{self.spec.name}'; and start the writers again"
            )

    # -- positions ------------------------------------------------------------------------

    async def load_positions(self, drop_others: bool) -> dict[str, int]:
        """Writer positions from `stream_positions`; with `drop_others`, rows of writers
        no longer configured are deleted first (a writer added back starts afresh).
        Outlasts a server restart (`Database.retry_read`: the delete is idempotent)."""

        async def load() -> dict[str, int]:
            async with self.db.connection() as conn:
                cursor = await self._load_positions_in(conn, drop_others)
                return await self._positions_from(cursor)

        return await self.db.retry_read(f"the positions of stream {self.spec.name}", load)

    async def _load_positions_in(
        self, conn: AsyncConnection[TupleRow], drop_others: bool
    ) -> AsyncCursor[TupleRow]:
        if drop_others:
            await conn.execute(
                "DELETE FROM stream_positions WHERE stream_name = %s"
                " AND NOT (instance_name = ANY(%s))",
                (self.spec.name, list(self.spec.writers)),
            )
        return await conn.execute(
            "SELECT instance_name, stream_id FROM stream_positions WHERE stream_name = %s",
            (self.spec.name,),
        )

    async def _positions_from(self, cursor: AsyncCursor[TupleRow]) -> dict[str, int]:
        writers = set(self.spec.writers)
        rows = await cursor.fetchall()
        return {name: self._sign * int(value) for name, value in rows if name in writers}

    async def upsert_position(self, instance: str, position: int, *, durable: bool) -> None:
        """Move `instance`'s row forwards to `position` (never backwards).

        Position rows are hints that start-up re-derives from the tables when they are
        stale, so routine updates use asynchronous commit and never wait for a disk
        flush: `set_config(..., true)` in the statement itself applies to the statement's
        own (implicit) transaction, so this stays one statement and one round trip.
        """
        source = (
            "(SELECT set_config('synchronous_commit', 'off', true)) AS async_commit"
            if not durable
            else "(SELECT 1) AS durable_commit"
        )
        # The sequence head is read in the same statement, and a position above it is
        # never written (R-ID-14): a corrupted in-memory position cannot reach the table.
        query = sql.SQL(
            "WITH head AS (SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END"
            " AS id FROM {seq}), moved AS ("
            " INSERT INTO stream_positions (stream_name, instance_name, stream_id)"
            " SELECT %(stream)s, %(inst)s, %(stored)s FROM {source}, head"
            " WHERE %(internal)s <= head.id"
            " ON CONFLICT (stream_name, instance_name)"
            " DO UPDATE SET stream_id = EXCLUDED.stream_id, updated_at = now()"
            " WHERE stream_positions.stream_id {keep} EXCLUDED.stream_id RETURNING 1)"
            " SELECT id FROM head"
        ).format(
            seq=self._seq,
            source=sql.SQL(source),
            keep=sql.SQL(">" if self.spec.backwards else "<"),
        )
        names = {
            "stream": self.spec.name,
            "inst": instance,
            "stored": self._sign * position,
            "internal": position,
        }
        async with self.db.scalar_cursor() as cur:
            await cur.execute(query, names)
            row = await cur.fetchone()
        head = None if row is None else int(row)
        if head is None or position > head:
            raise PositionAboveHeadError(
                f"stream {self.spec.name!r}: not storing {instance}'s position "
                f"{self._sign * position}: the sequence {self.spec.sequence!r} has handed out "
                f"IDs up to {self._sign * (head or 0)} only, so that position names no ID (a "
                "forged or corrupted position, or the sequence was reset)"
            )

    async def _largest(self, cursors: list[AsyncCursor[TupleRow]]) -> int | None:
        """The largest of one-value answers (one per table), internal domain; None if
        every answer is NULL."""
        values = [(await cursor.fetchone() or (None,))[0] for cursor in cursors]
        found = [self._sign * int(v) for v in values if v is not None]
        return max(found) if found else None

    # -- allocation ------------------------------------------------------------------------

    def next_id_sql(self) -> str:
        """An SQL expression that takes the next stream ID (stored form), for use inside a
        statement (`MultiWriterIdGenerator.insert`). Plain text: the name is validated."""
        expression = f"nextval('{self._seq_regclass}')"
        return f"(-{expression})" if self.spec.backwards else expression

    async def allocate(self, n: int) -> list[int]:
        """`n` new IDs from the sequence in one round trip, sorted. Also learns where
        the WAL stood after them (`allocated_lsn`, for `make_durable`): the last row,
        since UNION ALL runs its branches in order (nextval forbids a parallel plan)."""
        async with self.db.scalar_cursor() as cur:
            await cur.execute(
                "SELECT nextval(%s::regclass) FROM generate_series(1, %s) UNION ALL"
                " SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint",
                (self._seq_regclass, n),
            )
            ids: list[int] = await cur.fetchall()
        self.allocated_lsn = max(self.allocated_lsn, ids.pop())
        ids.sort()
        return ids

    async def make_durable(self, lsn: int) -> None:
        """Return once the WAL is on disk up to `lsn` (an `allocated_lsn`), so that the
        sequence's log record of IDs allocated before it survives a crash (R-ID-14).
        No round trip when a commit through this `Database` said so already (the row
        written with those IDs, most likely); else one statement, which also flushes
        when nothing did (`_DURABLE_QUERY`). Callers at once share one statement; when
        it fails, those that waited for it fail too, at once.

        Across a crash the LSNs of two server lifetimes may be compared wrongly; that is
        safe because every new connection first moves the sequence durably past the IDs
        this process took (`Database`: the catch-up's nextval logs, and its commit
        flushes)."""
        if self.db.wal.flushed >= lsn:
            return
        tries = self._durable_tries
        async with self._durable:
            if self.db.wal.flushed >= lsn:  # the statement before this one covered it
                return
            if self._durable_failure is not None and self._durable_failed_at > tries:
                raise DatabaseUnavailableError(
                    f"could not make sure PostgreSQL's log is on disk: {self._durable_failure}"
                )
            self._durable_tries += 1
            try:
                async with self.db.scalar_cursor() as cur:
                    await cur.execute(_DURABLE_QUERY, {"lsn": lsn, "name": self.spec.name})
                    flushed = await cur.fetchone()
                if flushed is None:  # the row is gone: write it again, then flush
                    async with self.db.connection() as conn:
                        await conn.execute(*record_spec_statement(self.spec))
                    await self.flush_wal()
                    flushed = lsn
            except (psycopg.Error, OSError, PlaitError) as err:
                self._durable_failure, self._durable_failed_at = err, self._durable_tries
                raise
            self.db.wal.flushed = max(self.db.wal.flushed, flushed)

    async def allocate_in(self, txn: Transaction, n: int) -> list[int]:
        """`n` new IDs in the caller's transaction; also learns the transaction's xid,
        and where the WAL stood after them (`Transaction.allocated_lsn`: a target list
        runs in order, so each row's position comes after its nextval)."""
        # Literal values, no parameters: a transaction's first statement then carries its
        # BEGIN in the same simple query. The name is validated, `n` an int.
        cur = await txn.execute(
            f"SELECT nextval('{self._seq_regclass}'), pg_current_xact_id()::text,"
            " pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint"
            f" FROM generate_series(1, {int(n)})"
        )
        rows = await cur.fetchall()
        if rows:
            txn.xid = rows[0][1]
            txn.allocated_lsn = max(txn.allocated_lsn, *(int(r[2]) for r in rows))
        return sorted(int(r[0]) for r in rows)


# `StreamStore.make_durable` in one round trip: the WAL's flush position when it is at
# `lsn` already; else, under `flush_wal`'s lock, the insert position (this statement's
# commit flushes past it); NULL if the row is gone. The scalar subquery runs only when
# CASE needs it (an initplan runs on first use).
_DURABLE_QUERY = """
SELECT CASE WHEN f.lsn >= %(lsn)s THEN f.lsn ELSE (
    SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint FROM plait_streams
    WHERE stream_name = %(name)s AND set_config('synchronous_commit', 'local', true) <> ''
    FOR KEY SHARE
) END
FROM (SELECT pg_wal_lsn_diff(pg_current_wal_flush_lsn(), '0/0')::bigint AS lsn) f
"""
