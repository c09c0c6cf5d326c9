"""The connection pool, transactions with after-commit hooks, migrations, instance map.

`Database` is where plait's connections come from. SQL about one stream lives in
`stream_store.py`; this module holds what every stream shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import getpass
import logging
import os
import select
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

import psycopg
from psycopg import AsyncConnection, AsyncCursor, pq, sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow, scalar_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from plait.core.backoff import Backoff
from plait.core.redact import redact
from plait.core.throttle import Throttle
from plait.errors import (
    ConfigError,
    DatabaseUnavailableError,
    FencedError,
    InvalidDsnError,
    NoConnectionError,
    StateError,
    SupersededError,
)
from plait.storage.embedded import EmbeddedPostgres
from plait.storage.incarnation import (
    Incarnation,
    name_connection,
    refuse_if_fenced,
    renew_incarnation,
)
from plait.storage.migrations import LATEST, MIGRATION_LOCK, MIGRATIONS
from plait.storage.timeouts import DEFAULT_TIMEOUTS, DatabaseTimeouts, connect_sync
from plait.tasks import to_the_end

logger = logging.getLogger(__name__)

MIN_SERVER_VERSION = 140000
# How long plait waits for a server that went away or is not up yet (a restart takes
# seconds, a crash's recovery tens of them) before it fails with
# DatabaseUnavailableError: its own reads, and an `Instance`'s start-up (the
# configuration's `database_patience`).
DEFAULT_RETRY_READS_FOR = 60.0
# A server that answered a connection attempt with one of these is there but not taking
# connections yet (or any more, or is full): trying again later may succeed. libpq
# gives connection failures no SQLSTATE, only the server's message.
_NOT_ACCEPTING_YET = (
    "starting up",
    "shutting down",
    "in recovery mode",
    "not yet accepting connections",
    "not accepting connections",
    "too many clients",
    "remaining connection slots",
)
# libpq's own refusals (no FATAL from a server): nothing changes them but the
# configuration (a password, certificates, SSL or GSS settings).
_REFUSED_FOR_GOOD = (
    "no password supplied",
    "password authentication failed",
    "SSL error",
    "certificate",
    "server does not support SSL",
    "GSSAPI",
    "invalid connection option",
    "invalid sslmode",
    "invalid port",
)
# SQLSTATEs of a server that ended the session: shut down by an administrator, crashed,
# or not accepting connections yet (starting up, shutting down, recovering).
_SERVER_WENT_AWAY = frozenset({"57P01", "57P02", "57P03"})
T = TypeVar("T")
_IDLE = pq.TransactionStatus.IDLE
Params = Sequence[Any] | Mapping[str, Any] | None


class CommitStatement(Protocol):
    """A statement sent in the same round trip as a transaction's COMMIT
    (`Transaction.send_with_commit`), so writing it costs no round trip of its own."""

    def statement(self) -> tuple[str, Params]:
        """The statement and its parameters, built when COMMIT is sent."""
        ...

    def sending(self) -> None:
        """Called just before the statement leaves, after `statement()`."""
        ...

    def committed(self, columns: list[str] | None, records: list[TupleRow] | None) -> None:
        """COMMIT succeeded: the statement's column names and rows (None when it
        returned none). Runs with the transaction's other after-commit callbacks, after
        them."""
        ...

    def failed(self) -> None:
        """The transaction ended without committing this statement, or how it ended is
        unknown and the server has finished it since (also called when the statement
        was never sent)."""
        ...


class Transaction:
    """An open transaction on one pooled connection.

    BEGIN is not sent on its own: it travels with the first statement (in the same simple
    query when that has no parameters, else in psycopg's pipeline mode), so a
    transaction costs one round trip less. `call_after` callbacks run after
    COMMIT succeeded, `call_on_exception` callbacks after it rolled back or failed; both
    run only once the server has finished the transaction. Statements given to
    `send_with_commit` travel with COMMIT itself.
    """

    def __init__(self, conn: AsyncConnection[TupleRow], db: Database) -> None:
        self._conn = conn
        self._db = db
        self._begun = False
        self._ended = False
        self._first_after_commit: list[Callable[[], None]] = []
        self._after_commit: list[Callable[[], None]] = []
        self._after_rollback: list[Callable[[], None]] = []
        self._with_commit: list[CommitStatement] = []
        # Set when something in the transaction learned its xid (see `allocate_in`), so
        # an interrupted COMMIT can be waited out instead of guessed.
        self.xid: str | None = None
        # The server process that ran COMMIT with statements: when the connection broke
        # meanwhile, plait waits until that process is gone (its work is then final).
        self.backend_pid: int | None = None
        # Where the WAL stood after the transaction took IDs (`allocate_in`); then COMMIT
        # also reads how far the WAL is on disk (`flushed_lsn`), in the same round trip:
        # a commit that wrote nothing flushes nothing (R-ID-14, `StreamStore`). So it
        # does while a `get_next` block is open (`Database.wal_watchers`): the block's
        # exit then knows without a round trip of its own.
        self.allocated_lsn = 0
        self.flushed_lsn: int | None = None

    async def execute(self, query: Any, params: Params = None) -> AsyncCursor[TupleRow]:
        if self._begun:
            return await self._conn.execute(query, params)
        if params is None and isinstance(query, str):
            # Without parameters both go in one simple query: one round trip, without
            # the client CPU that pipeline mode costs.
            self._begun = True
            cursor = await self._conn.execute("BEGIN; " + query)
            cursor.nextset()
            return cursor
        async with self._conn.pipeline():
            await self._begin()
            return await self._conn.execute(query, params)

    async def executemany(
        self, query: Any, params_seq: Iterable[Sequence[Any] | Mapping[str, Any]]
    ) -> None:
        async with self._conn.pipeline():
            await self._begin()  # queued in the pipeline with the statements
            async with self._conn.cursor() as cursor:
                await cursor.executemany(query, params_seq)

    async def connection(self) -> AsyncConnection[TupleRow]:
        """The connection, inside the transaction (for cursors, COPY, nested blocks)."""
        await self._begin()
        return self._conn

    async def _begin(self) -> None:
        if not self._begun:
            self._begun = True  # from here on, ending it sends ROLLBACK or COMMIT
            await self._conn.execute("BEGIN")

    def call_after(self, callback: Callable[[], None], *, first: bool = False) -> None:
        """Run `callback` once COMMIT succeeded; with `first`, before every callback
        registered without it (cache invalidations run before any stream ID of the
        transaction completes, so nothing sees the new position with stale caches)."""
        (self._first_after_commit if first else self._after_commit).append(callback)

    def call_on_exception(self, callback: Callable[[], None]) -> None:
        self._after_rollback.append(callback)

    @property
    def ended(self) -> bool:
        """Whether COMMIT or ROLLBACK was sent (nothing more can join the transaction)."""
        return self._ended

    def check_open(self) -> None:
        if self._ended:
            raise StateError(
                "this transaction has ended already; write inside the `async with "
                "db.transaction()` block"
            )

    def send_with_commit(self, statement: CommitStatement) -> None:
        """Send `statement` in the same round trip as COMMIT (pipelined), built only
        then: writes gathered during the transaction cost no round trip of their own."""
        self.check_open()
        self._with_commit.append(statement)
        self._after_rollback.append(statement.failed)

    async def _end(self, command: str) -> None:
        self._ended = True
        if command == "COMMIT" and self._with_commit:
            await self._commit_with_statements()
            return
        if not self._begun:
            return
        if command == "ROLLBACK" and self._conn.closed:
            # The session is gone (the server ended it: idle_in_transaction_session_timeout,
            # a terminated backend), and its transaction with it. Sending ROLLBACK would
            # only replace the error that says why with "the connection is closed".
            return
        if command == "COMMIT" and self._wants_flushed():
            # Pipelined and prepared: one round trip, and no parse or plan per commit.
            async with self._conn.pipeline():
                cursor = await self._conn.execute("COMMIT")
                flushed = await self._conn.execute(FLUSHED_LSN_QUERY, prepare=True)
            committed = cursor.statusmessage == "COMMIT"
            if committed:
                self._note_flushed(await flushed.fetchone())
        else:
            cursor = await self._conn.execute(command)
            committed = cursor.statusmessage == "COMMIT"
        if command == "COMMIT" and not committed:
            raise _rolled_back_at_commit()

    def _wants_flushed(self) -> bool:
        return bool(self.allocated_lsn or self._db.wal_watchers)

    def _note_flushed(self, row: tuple[Any, ...] | None) -> None:
        if row is not None:
            self.flushed_lsn = int(row[0])
            self._db.wal_flushed = max(self._db.wal_flushed, self.flushed_lsn)

    async def _commit_with_statements(self) -> None:
        """[BEGIN,] the statements and COMMIT in one pipeline: one round trip, and the
        statements stay prepared (psycopg prepares repeated ones)."""
        conn, statements = self._conn, self._with_commit
        built = [statement.statement() for statement in statements]
        self.backend_pid = server_pid(conn)
        for statement in statements:
            statement.sending()
        try:
            # Leaving the pipeline block sends the one Sync and reads every result.
            async with conn.pipeline():
                await self._begin()
                cursors = [await conn.execute(query, params) for query, params in built]
                commit = await conn.execute("COMMIT")
                flushed = (
                    await conn.execute(FLUSHED_LSN_QUERY, prepare=True)
                    if self._wants_flushed()
                    else None
                )
        except psycopg.errors.InFailedSqlTransaction:
            raise _rolled_back_at_commit() from None
        if commit.statusmessage != "COMMIT":
            raise _rolled_back_at_commit()
        if flushed is not None:
            self._note_flushed(await flushed.fetchone())
        for statement, cursor in zip(statements, cursors, strict=True):
            description = cursor.description
            if description is None:
                columns, records = None, None
            else:
                columns = [column.name for column in description]
                records = await cursor.fetchall()
            self._after_commit.append(functools.partial(statement.committed, columns, records))

    def _run_after_commit(self) -> None:
        self._run(self._first_after_commit)
        self._run(self._after_commit)

    def _run(self, callbacks: list[Callable[[], None]]) -> None:
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("transaction callback %r failed", callback)


# How far the WAL is on disk, in bytes (an LSN as a number).
FLUSHED_LSN_QUERY = "SELECT pg_wal_lsn_diff(pg_current_wal_flush_lsn(), '0/0')::bigint"


def _rolled_back_at_commit() -> psycopg.errors.InFailedSqlTransaction:
    # The server answers COMMIT with ROLLBACK when a statement failed earlier.
    return psycopg.errors.InFailedSqlTransaction(
        "the transaction was rolled back at COMMIT because a statement in it failed "
        "earlier (and the error was caught); nothing was committed"
    )


class _Identity:
    """Who a pool's connections say they are, the server settings each one starts
    with, and what happens when a new one finds that run fenced.

    With `renew` (the default), the instance goes on as a new incarnation: a fence
    proved that none of the old one's connections was alive, so everything it did is
    committed or rolled back. The new connection takes a new epoch's name and moves
    the fenced rows to that epoch before it is handed out, under their row locks, so no
    allocation happens before the writer is registered again and a fence in progress
    is waited out. But only once nothing of the old run is pending (`holds`): an ID it
    took before the fence, still held by a `get_next` block, could otherwise be
    written on a new connection below the position the fence moved readers past.
    Until then, and always without `renew`, every lease fails at once (`FencedError`).
    A run superseded by a later run of the instance never goes on (`SupersededError`):
    the later one writes under that name now."""

    __slots__ = (
        "_catching_up",
        "_renewing",
        "_sequence_warnings",
        "fenced",
        "heads",
        "heard",
        "holds",
        "incarnation",
        "pooled",
        "registered",
        "renew",
        "renewed",
        "restarted_at",
        "server_start",
        "settings",
        "superseded",
    )

    def __init__(
        self,
        incarnation: Incarnation | None = None,
        settings: Mapping[str, str] | None = None,
        *,
        renew: bool = True,
    ) -> None:
        self.incarnation = incarnation
        self.settings = dict(settings or {})
        # The largest ID (internal domain) this process knows each sequence handed
        # out (`Database.known_head`); new connections bring a sequence that went
        # back up to it first (`_catch_up_sequences`).
        self.heads: dict[str, int] = {}
        # Heads heard from other processes soon after PostgreSQL restarted, not yet
        # caught up to (`Database.note_head`); when the server started, as the
        # connections made so far saw it, and when a new one found it restarted.
        self.heard: dict[str, int] = {}
        self._catching_up = asyncio.Lock()
        self.server_start: datetime | None = None
        self.restarted_at: float | None = None
        self._sequence_warnings = Throttle(60.0)  # per sequence, not per connection
        self.fenced: FencedError | None = None
        self.renew = renew
        # Each says whether IDs of this run are still pending (the writers' trackers).
        self.holds: list[Callable[[], bool]] = []
        # The streams this run registered its epoch on (`Database.registered`).
        self.registered: set[str] = set()
        # Called with the new incarnation (the pool names later connections after it).
        self.renewed: Callable[[Incarnation], None] | None = None
        # Called once when a later run of the instance superseded this one.
        self.superseded: list[Callable[[], None]] = []
        self._renewing = asyncio.Lock()  # one renewal at a time
        # A pooler sits between plait and the server (`_probe`): each connection learns
        # the id of the server process behind it (`server_pid`).
        self.pooled = False

    def may_renew(self) -> bool:
        if isinstance(self.fenced, SupersededError):
            return False
        return self.renew and not any(pending() for pending in self.holds)

    async def configure(self, conn: AsyncConnection[TupleRow]) -> None:
        """The pool's hook for each new connection. One it refuses is closed here:
        psycopg_pool drops it unclosed, and its server process, named after this run,
        would live on until the garbage collector got to it, keeping a fenced run
        looking alive to the others' fences while it retried (issue 18)."""
        try:
            await self._configure(conn)
        except BaseException:
            await conn.close()
            raise

    async def _configure(self, conn: AsyncConnection[TupleRow]) -> None:
        if self.settings or self.pooled:
            # SET after connecting rather than `options` in the startup packet, which
            # PgBouncer refuses: one round trip per new connection, which also asks for
            # the server process's id behind a pooler.
            cursor = await conn.execute(_set_query(self.settings, with_pid=self.pooled))
            if self.pooled:
                row = await cursor.fetchone()
                assert row is not None
                _SERVER_PIDS[conn] = int(row[0])
        # The sequences first, then the fence: a run that finds itself fenced finishes
        # the IDs it took (`MultiWriterIdGenerator._finish_flushed`), trusting that the
        # sequence is durably past them; after a crash that took the sequence back
        # only this catch-up makes it so (its nextval logs, and its commit flushes).
        # Moving a sequence up is harmless for a fenced run: it writes no row.
        if self.heads or self.incarnation is not None:  # a writer's, or one that knows heads
            await self._catch_up_sequences(conn, self.heads, new=True)
        await self._check_fence(conn)

    def must_catch_up(self) -> bool:
        """Whether a lease must `catch_up_heard` before its statement (cheap: it runs
        before every statement)."""
        return bool(self.heard) or self._catching_up.locked()

    async def catch_up_heard(self, conn: AsyncConnection[TupleRow]) -> None:
        """Catch up the heads in `heard`, one lease at a time: the others wait for it,
        then find nothing left or what was heard meanwhile (kept when the connection
        breaks)."""
        async with self._catching_up:
            heard, self.heard = self.heard, {}
            if not heard:
                return
            try:
                await self._catch_up_sequences(conn, heard, new=False)
            except BaseException:
                for name, head in heard.items():
                    self.heard[name] = max(head, self.heard.get(name, 0))
                raise

    def _note_server_start(self, started: datetime | None) -> None:
        if self.server_start is not None and started != self.server_start:
            self.restarted_at = time.monotonic()
        self.server_start = started

    async def _catch_up_sequences(
        self, conn: AsyncConnection[TupleRow], heads: Mapping[str, int], *, new: bool
    ) -> None:
        """Move each sequence this process took or saw IDs from back up to the largest
        it knows was handed out, before the connection serves anything (R-ID-14).

        PostgreSQL logs a sequence 32 values ahead, and that log record reaches the
        disk only when something flushes the WAL (a commit, the WAL writer). A crash
        soon after a transaction that took IDs rolled back can bring the sequence back
        below them, to hand them out again; a writer may have reported one as its
        position (finished, without a row), and readers passed it. After a crash
        every statement runs on a new connection, so this comes first. A `new`
        connection also says when the server started (same round trip): a head heard
        from another process soon after a restart is caught up too (`Database.note_head`)."""
        by_text = {regclass_text(name): name for name in heads}
        params = {
            "names": list(by_text),
            "known": [heads[name] for name in by_text.values()],
            "limit": SEQUENCE_CATCH_UP_LIMIT,
        }
        try:
            if new:
                async with conn.pipeline():
                    started = await conn.execute("SELECT pg_postmaster_start_time()")
                    caught_up = await conn.execute(_CATCH_UP_QUERY, params) if heads else None
                row = await started.fetchone()
                self._note_server_start(None if row is None else row[0])
            else:
                caught_up = await conn.execute(_CATCH_UP_QUERY, params)
            rows = [] if caught_up is None else await caught_up.fetchall()
        except psycopg.Error as err:
            if conn.broken:
                raise
            if self._sequence_warnings.allow("check", time.monotonic()) is not None:
                logger.warning("could not check the streams' sequences (new connection): %s", err)
            return
        for text, known, head, taken in rows:
            name = by_text.get(text, text)
            if taken:
                logger.warning(
                    "sequence %s was at %d, below ID %d that it handed out before: a "
                    "PostgreSQL crash lost its last log record. Took %d value(s) from it "
                    "so that no ID is handed out twice",
                    name,
                    head,
                    known,
                    taken,
                )
            elif self._sequence_warnings.allow(name, time.monotonic()) is not None:
                logger.error(
                    "sequence %s is at %d, %d below ID %d that it handed out before: more "
                    "than a crash takes back, so it was reset. Not moving it; writers "
                    "refuse IDs at or below the ones they saw (SequenceBehindError)",
                    name,
                    head,
                    known - head,
                    known,
                )

    async def _check_fence(self, conn: AsyncConnection[TupleRow]) -> None:
        """Refuse the connection when this run was fenced, or renew the incarnation."""
        checked = self.incarnation
        if checked is None:
            return
        try:
            await refuse_if_fenced(conn, checked, self.registered)
        except FencedError as err:
            if isinstance(err, SupersededError):
                # Rows under an epoch not `checked`'s: a later run's, or this run's own
                # renewal (another connection, under way or just done). Check again.
                async with self._renewing:
                    renewed = self.incarnation is not checked
                if renewed:
                    await self._check_fence(conn)
                    return
            if isinstance(err, SupersededError) or not self.may_renew():
                first = isinstance(err, SupersededError) and not isinstance(
                    self.fenced, SupersededError
                )
                self.fenced = err
                if first:
                    for listener in self.superseded:
                        listener()
                raise
            async with self._renewing:
                if self.incarnation is checked:  # else another connection renewed
                    new = Incarnation.new(checked.instance)
                    # The rows move first (committed), the name switches after: if
                    # this fails, the next connection finds the old run fenced again
                    # and retries, rather than living on under a name nobody fences by.
                    await renew_incarnation(conn, checked, new)
                    self.incarnation, self.fenced = new, None
                    logger.warning(
                        "%s; continuing as a new incarnation (epoch %d): its writers are "
                        "registered again before they allocate",
                        str(err).split(": another instance", 1)[0],
                        new.epoch,
                    )
                    if self.renewed is not None:
                        self.renewed(new)
                    return
        current = self.incarnation
        assert current is not None
        if conn.info.parameter_status("application_name") != current.application_name:
            # Made under the old name while another connection renewed: a fence
            # counts only connections carrying the registered epoch's name.
            await name_connection(conn, current)


# How long after a new connection found PostgreSQL restarted a head heard from another
# process is caught up before this process's next statement (`Database.note_head`):
# longer than a position message sent before the crash takes to arrive once the server
# is back. It costs one more statement before each statement of a writer that heard a
# head above the ones it knew, within this window only (about half its write rate).
HEARD_AFTER_RESTART = 10.0

# Values a sequence is moved up by at most (`_catch_up_sequences`): far more than a
# crash takes it back. One further behind was reset, not crashed: left alone (start-up
# refuses to go on from a sequence behind the stored positions, `SequenceBehindError`).
SEQUENCE_CATCH_UP_LIMIT = 1_000_000

# For each sequence below what this process knows it handed out: its head, and the
# values taken to bring it up, with nextval, which never moves a sequence back (setval's
# read-then-set would race with others' nextval). Skipped: sequences gone, not
# sequences, not ours to use, never called or reset with setval(..., false) (no head to
# compare), and ones further behind than the limit.
_CATCH_UP_QUERY = """
WITH known AS MATERIALIZED (
    SELECT c.oid::regclass AS seq, u.name, u.known
    FROM unnest(%(names)s::text[], %(known)s::bigint[]) AS u(name, known)
    JOIN pg_class c ON c.oid = to_regclass(u.name)
    -- CASE: the privilege check errs on a relation that is not a sequence.
    WHERE CASE WHEN c.relkind = 'S' THEN has_sequence_privilege(c.oid, 'USAGE') END
), behind AS (
    SELECT seq, name, known, pg_sequence_last_value(seq) AS head FROM known
)
SELECT b.name, b.known, b.head, CASE WHEN b.known - b.head > %(limit)s THEN 0 ELSE (
    SELECT count(v) FROM (SELECT nextval(b.seq) AS v FROM generate_series(1, b.known - b.head)) x
) END
FROM behind b
WHERE b.head < b.known
"""


def regclass_text(name: str) -> str:
    """A table or sequence name, schema-qualified or not, as text for `::regclass`."""
    # Names are validated by StreamSpec (no quotes), so this quoting is exact.
    return ".".join(f'"{part}"' for part in name.split("."))


def _set_query(settings: Mapping[str, str], *, with_pid: bool = False) -> sql.Composed:
    columns: list[sql.Composable] = [sql.SQL("pg_backend_pid()")] if with_pid else []
    columns.extend(
        sql.SQL("set_config({}, {}, false)").format(sql.Literal(name), sql.Literal(value))
        for name, value in settings.items()
    )
    return sql.SQL("SELECT {}").format(sql.SQL(", ").join(columns))


# The server process behind each connection made through a pooler, which gives its
# clients process ids of its own at login (`BackendKeyData`, `conn.info.backend_pid`).
_SERVER_PIDS: weakref.WeakKeyDictionary[AsyncConnection[Any], int] = weakref.WeakKeyDictionary()


def server_pid(conn: AsyncConnection[Any]) -> int:
    """The id of the PostgreSQL process serving `conn`, as pg_stat_activity knows it
    (what `Database.wait_finished` waits on), also behind PgBouncer."""
    return _SERVER_PIDS.get(conn) or conn.info.backend_pid


class _Lease:
    """`Database.connection()`: the hot connection while it is free, else a pooled one.

    The hot connection is kept out of the pool because a pool checkout costs as much
    client CPU as a small statement. A class rather than a generator-based context
    manager for the same reason: it runs on every write. Any error, cancellation or
    transaction left open hands the hot connection back to the pool, which rolls it back
    or replaces it.
    """

    __slots__ = ("_db", "_hot", "_pooled")

    def __init__(self, db: Database) -> None:
        self._db = db
        self._hot: AsyncConnection[TupleRow] | None = None
        self._pooled: AbstractAsyncContextManager[AsyncConnection[TupleRow]] | None = None

    async def __aenter__(self) -> AsyncConnection[TupleRow]:
        db = self._db
        identity = db._identity
        if identity.fenced is not None and not identity.may_renew():
            raise identity.fenced
        conn = await self._take()
        for _ in range(_DEAD_IDLE_TRIES):
            if not _closed_while_idle(conn):
                break
            # The server ended it while it sat idle (a restart, a crash): replace it
            # (and test the others) rather than fail the caller's statement on it.
            await self._drop(conn)
            conn = await self._take()
        if identity.must_catch_up():
            try:
                await identity.catch_up_heard(conn)
            except BaseException as exc:
                await self.__aexit__(type(exc), exc, exc.__traceback__)
                raise
        return conn

    async def _take(self) -> AsyncConnection[TupleRow]:
        db = self._db
        if db._lost_one and not db._closed:
            await db._replace_lost()
        if db._hot_busy or db._closed:
            return await _pooled_connection(db, self)
        db._hot_busy = True
        try:
            hot = db._hot
            if hot is None or hot.closed:
                hot = db._hot = await _waiting(db, db._pool.getconn)
        except BaseException:
            db._hot_busy = False
            raise
        self._hot = hot
        return hot

    async def _drop(self, conn: AsyncConnection[TupleRow]) -> None:
        """Give back a connection found dead before use; the pool discards it. The
        lease lets go of it before the first await (a cancellation then leaks
        nothing); closed first, so that the pool's exit does not try to use it."""
        db = self._db
        db._lost()
        pooled, self._pooled = self._pooled, None
        if pooled is None:
            self._hot = db._hot = None
            db._hot_busy = False
        await conn.close()
        if pooled is not None:
            await pooled.__aexit__(None, None, None)
        else:
            await db._pool.putconn(conn)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        db = self._db
        if isinstance(exc, psycopg.OperationalError) and connection_lost(exc):
            db._lost()
        if self._pooled is not None:
            await self._pooled.__aexit__(exc_type, exc, tb)
            return
        hot = self._hot
        assert hot is not None
        try:
            if db._closed:
                db._hot = None
                await hot.close()  # the database closed while we were using it
            elif exc_type is not None or hot.pgconn.transaction_status != _IDLE:
                db._hot = None
                await db._pool.putconn(hot)
        finally:
            db._hot_busy = False


# How many connections found dead before use a lease replaces before it hands out the
# next one anyway: after the first, the pool's idle ones are tested (`_replace_lost`).
_DEAD_IDLE_TRIES = 3


def _closed_while_idle(conn: AsyncConnection[TupleRow]) -> bool:
    """Whether the server ended this idle connection while nobody used it (a restart, a
    crash, `pg_terminate_backend`): an idle connection has nothing to read, one the
    server ended has its last words (FATAL) and the end of the stream, either of which
    tells. One poll with no wait, a few µs. What arrives otherwise (a notification, a
    parameter) is parsed here and notifications handed to psycopg, as its own
    statements would: `notifies()` waits on the socket, and would not see what this
    read from it."""
    pgconn = conn.pgconn
    if pgconn.status != pq.ConnStatus.OK:
        return True
    if not hasattr(select, "poll"):  # Windows: the statement finds out
        return False
    consumed = fatal = False
    try:
        poller = select.poll()
        poller.register(pgconn.socket, select.POLLIN)
        if not poller.poll(0):
            return False  # nearly always: nothing arrived
        # libpq hands what the server says while idle, a FATAL included, to the
        # notice handler: its last words count as the end, which may arrive later.
        handler = pgconn.notice_handler

        def notice(result: pq.abc.PGresult) -> None:
            nonlocal fatal
            severity = result.error_field(pq.DiagnosticField.SEVERITY_NONLOCALIZED)
            fatal = fatal or severity in (b"FATAL", b"PANIC")
            if handler is not None:
                handler(result)

        pgconn.notice_handler = notice
        try:
            for _ in range(4):  # the server's message, then the end of the stream
                pgconn.consume_input()
                pgconn.is_busy()  # parses what was read (consume_input only buffers)
                consumed = True
                if fatal or not poller.poll(0):
                    break
        finally:
            pgconn.notice_handler = handler
    except (psycopg.OperationalError, OSError):
        return True
    if fatal or pgconn.status != pq.ConnStatus.OK:
        return True
    while consumed and (notify := pgconn.notifies()) is not None:
        if pgconn.notify_handler is not None:
            pgconn.notify_handler(notify)
    return False


# psycopg_pool retries a failed connection with a doubling delay for up to this long,
# then gives up until a client waits again. Its default (5 min) let the delay grow to
# a minute or more during an outage, so a process found the server back that late; a
# short chain starts over when a waiting lease looks again (`_waiting`).
_RECONNECT_CHAIN = 5.0
# While waiting for the pool, a lease looks again after this long, then after twice
# as long each time: whether the pool's connection attempts found this run fenced (then
# it fails at once, not after the pool's timeout), and to start a fresh reconnect chain.
# Doubling: each look puts the lease at the back of the pool's queue.
_FIRST_LOOK = 1.0


async def _waiting(db: Database, get: Callable[[float], Awaitable[T]]) -> T:
    """`get(timeout)` from the pool, up to the pool's own timeout, failing with
    `FencedError` as soon as a connection attempt found this run fenced."""
    identity, pool = db._identity, db._pool
    loop = asyncio.get_running_loop()
    deadline = loop.time() + pool.timeout
    step = _FIRST_LOOK
    while True:
        try:
            return await get(max(0.001, min(step, deadline - loop.time())))
        except PoolTimeout:
            if identity.fenced is not None and not identity.may_renew():
                raise identity.fenced from None
            if loop.time() >= deadline:
                raise NoConnectionError(
                    f"no connection to PostgreSQL at {db._server} within {pool.timeout:g} s: "
                    "the server did not answer, or every connection of the pool stayed busy "
                    f"({pool.max_size} at most): check that the server is up, and give the "
                    "pool more connections (max_size) or hold them for shorter"
                ) from None
            step *= 2


async def _pooled_connection(db: Database, lease: _Lease) -> AsyncConnection[TupleRow]:
    async def enter(wait: float) -> AsyncConnection[TupleRow]:
        pooled = db._pool.connection(timeout=wait)
        conn = await pooled.__aenter__()
        lease._pooled = pooled
        return conn

    return await _waiting(db, enter)


class _CursorLease:
    """`Database.scalar_cursor()`: on the hot connection, the same cursor every time (a new
    psycopg cursor per statement costs more client CPU than the rest of a small write);
    on a pooled connection, a new one. Rows are scalars (the first column)."""

    __slots__ = ("_lease",)

    def __init__(self, db: Database) -> None:
        self._lease = _Lease(db)

    async def __aenter__(self) -> AsyncCursor[Any]:
        lease = self._lease
        conn = await lease.__aenter__()
        if lease._hot is None:
            return conn.cursor(row_factory=scalar_row)
        db = lease._db
        cursor = db._hot_cursor
        if cursor is None or cursor.connection is not conn:
            cursor = db._hot_cursor = conn.cursor(row_factory=scalar_row)
        return cursor

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._lease.__aexit__(exc_type, exc, tb)


class Database:
    """A psycopg 3 async pool on PostgreSQL 14+, or on the embedded server."""

    def __init__(
        self,
        pool: AsyncConnectionPool[AsyncConnection[TupleRow]],
        dsn: str,
        embedded: EmbeddedPostgres | None,
        identity: _Identity | None = None,
        *,
        retry_reads_for: float = DEFAULT_RETRY_READS_FOR,
    ) -> None:
        self._pool = pool
        # One connection kept out of the pool and lent to whoever needs a connection
        # while it is free: a pool checkout costs about as much client CPU as a small
        # statement does, and most of plait's work is one statement at a time.
        self._hot: AsyncConnection[TupleRow] | None = None
        self._hot_busy = False
        self._hot_cursor: AsyncCursor[Any] | None = None
        self._dsn = dsn
        self._embedded = embedded
        self._instance_ids: dict[str, int] = {}
        self._instance_names: dict[int, str] = {}
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._closed = False
        self._identity = identity or _Identity()
        self._retry_reads_for = retry_reads_for
        # Set when a connection was found dead (`_lost`): the next lease first tests the
        # idle connections (`_replace_lost`).
        self._lost_one = False
        self._connections_lost = 0  # `connections_lost`
        self._replacing: asyncio.Task[None] | None = None
        self._outage = _Outage()  # one warning per outage, not per reader
        # How far PostgreSQL's WAL is known to be on disk (an LSN in bytes), and how many
        # `get_next` blocks want to know (R-ID-14): commits then read it (`Transaction`).
        self.wal_flushed = 0
        self.wal_watchers = 0
        self._guard = asyncio.create_task(self._close_on_shutdown(), name="plait-pool-guard")

    @classmethod
    async def connect(
        cls,
        dsn: str | None = None,
        *,
        data_dir: Path | None = None,
        min_size: int = 1,
        max_size: int = 10,
        application_name: str = "plait",
        incarnation: Incarnation | None = None,
        retry_reads_for: float = DEFAULT_RETRY_READS_FOR,
        wait_for_server: float = 0.0,
        timeouts: DatabaseTimeouts | None = None,
    ) -> Database:
        """Connect to `dsn`, or start (or reuse) the embedded server when it is None.

        With an `incarnation` (what `Instance` passes) every connection carries its
        name, so that the instance's writers can be fenced when it dies, and a new
        connection is refused once they were (`FencedError`). plait's reads of
        positions and rows, and the start of a stream's generator, outlast a server
        restart or crash of up to `retry_reads_for` seconds (`retry_read`,
        `retry_idempotent`). Connecting itself waits up to `wait_for_server` seconds
        for a server that is not up yet (refuses connections, is starting or
        recovering); 0, the default, tries once. A server that refuses us for good (a
        wrong password or database name) fails at once. `timeouts` (default:
        `DatabaseTimeouts()`) bound how long a silent peer keeps a connection, on both
        ends, so that a partitioned writer's server processes end and it can be fenced;
        what `dsn` sets itself wins."""
        if retry_reads_for < 0:
            raise ConfigError("retry_reads_for must be zero or more (seconds)")
        if wait_for_server < 0:
            raise ConfigError("wait_for_server must be zero or more (seconds)")
        embedded = None
        if dsn is None:
            embedded = await asyncio.to_thread(EmbeddedPostgres.acquire, data_dir)
            dsn = embedded.dsn
        timeouts = timeouts or DEFAULT_TIMEOUTS
        identity = _Identity(incarnation, timeouts.session_settings(dsn))
        if incarnation is not None:
            application_name = incarnation.application_name
        client = timeouts.client_params(dsn)
        kwargs: dict[str, Any] = {
            "autocommit": True,
            "application_name": application_name,
            **client,
        }
        # A renewed incarnation names every later connection (the pool reads its
        # kwargs for each one it makes).
        identity.renewed = lambda new: kwargs.update(application_name=new.application_name)

        async def open_pool() -> AsyncConnectionPool[AsyncConnection[TupleRow]]:
            identity.pooled = await _probe(dsn, client)
            pool: AsyncConnectionPool[AsyncConnection[TupleRow]] = AsyncConnectionPool(
                dsn,
                min_size=min_size,
                max_size=max_size,
                kwargs=kwargs,
                configure=identity.configure,
                open=False,
                name="plait",
                reconnect_timeout=_RECONNECT_CHAIN,
            )
            try:
                await pool.open(wait=True, timeout=30)
            except BaseException:
                await pool.close()  # its workers would retry on their own
                raise
            return pool

        def unreachable(seconds: float, reason: str) -> DatabaseUnavailableError:
            if not wait_for_server:
                return cannot_connect(dsn, reason)
            return DatabaseUnavailableError(
                f"could not connect to PostgreSQL at {server_address(dsn)}: it has been "
                f"unreachable for {seconds:.0f} s ({reason}). Check that the server is up "
                "and reachable at that address (host, port), or give it longer "
                "(database_patience in the configuration; wait_for_server of Database.connect)",
                server=server_address(dsn),
                reason=reason,
                waited=seconds,
            )

        try:
            pool = await _outlast(
                open_pool,
                patience=wait_for_server,
                server=server_address(dsn),
                doing="connect",
                transient=may_come_up,
                giving_up=unreachable,
                outage=_Outage(),
            )
        except BaseException:
            if embedded is not None:
                await asyncio.to_thread(embedded.release)
            raise
        return cls(pool, dsn, embedded, identity, retry_reads_for=retry_reads_for)

    @property
    def dsn(self) -> str:
        """The connection string, for other processes and tools (Spark, psql)."""
        return self._dsn

    @property
    def embedded(self) -> EmbeddedPostgres | None:
        return self._embedded

    @property
    def incarnation(self) -> Incarnation | None:
        """Who this pool's connections say they are (`connect(incarnation=...)`)."""
        return self._identity.incarnation

    @property
    def connections_lost(self) -> int:
        """How many connections were found dead so far (under a statement, or idle
        before use). When it grows, the server may have restarted or crashed, and a
        crash loses what was committed asynchronously since its last WAL flush
        (position rows)."""
        return self._connections_lost

    def connection(self) -> AbstractAsyncContextManager[AsyncConnection[TupleRow]]:
        """A pooled connection in autocommit mode."""
        return _Lease(self)

    def scalar_cursor(self) -> AbstractAsyncContextManager[AsyncCursor[Any]]:
        """A cursor on a pooled connection in autocommit mode, for plait's own hot
        statements: its rows are the first column's values (`scalar_row`); read them
        inside the block (the next user reuses the cursor)."""
        return _CursorLease(self)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        """A transaction; committed when the block exits normally, else rolled back.

        COMMIT and ROLLBACK run to completion even if the calling task is cancelled
        meanwhile: callbacks must know how the transaction ended.
        """
        async with self.connection() as conn:
            txn = Transaction(conn, self)
            try:
                yield txn
            except BaseException as exc:
                try:
                    _, cancelled = await to_the_end(txn._end("ROLLBACK"))
                finally:
                    txn._run(txn._after_rollback)
                if cancelled and not isinstance(exc, asyncio.CancelledError):
                    raise asyncio.CancelledError from exc
                if isinstance(exc, psycopg.Rollback):  # rolled back on purpose
                    return
                raise
            try:
                _, cancelled = await to_the_end(txn._end("COMMIT"))
            except BaseException as exc:
                if isinstance(exc, psycopg.OperationalError):  # did it commit? wait it out
                    await self.wait_finished(xid=txn.xid, backend_pid=txn.backend_pid)
                txn._run(txn._after_rollback)
                raise
            txn._run_after_commit()
            if cancelled:
                raise asyncio.CancelledError

    async def wait_finished(
        self, *, xid: str | None = None, backend_pid: int | None = None, patience: float = 60.0
    ) -> None:
        """Wait until the server has finished work whose connection broke before it
        answered: until transaction `xid` is no longer in progress when it is known,
        else until server process `backend_pid` runs no statement (it finishes what it
        was running, then notices the broken connection and exits). Its outcome is
        final then: a read from here on sees it if it committed."""
        args: tuple[object, ...]
        if xid is not None:
            query, args, what = (
                "SELECT pg_xact_status(%s::xid8) = 'in progress'",
                (xid,),
                f"transaction {xid}",
            )
        elif backend_pid:
            query, args, what = (
                # Asked on that very connection, it is running only this query.
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = %s"
                " AND pid <> pg_backend_pid() AND state IS DISTINCT FROM 'idle')",
                (backend_pid,),
                f"server process {backend_pid}",
            )
        else:
            return  # nothing learned about it: nothing to wait for
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        while loop.time() < deadline:
            try:
                async with self.connection() as conn:
                    row = await (await conn.execute(query, args)).fetchone()
                if row is None or not row[0]:
                    return
            except psycopg.Error:
                pass
            await asyncio.sleep(0.05)
        logger.error("%s still running after %.0f s; giving up waiting", what, patience)

    async def retry_read(self, what: str, read: Callable[[], Awaitable[T]]) -> T:
        """`await read()`, again on new connections (with backoff) while it fails
        because the server went away (restarted, crashed, failed over, or not yet
        accepting connections), for up to `retry_reads_for` seconds; then
        `DatabaseUnavailableError`. For reads only: a write whose connection died may
        have committed. `what` names the read in the log lines and the error."""
        return await self.retry_idempotent(f"read {what}", read)

    async def retry_idempotent(self, what: str, step: Callable[[], Awaitable[T]]) -> T:
        """`retry_read` for a step that may run twice with the same outcome, writes
        included (start-up: migrating, creating a sequence, registering a writer
        forwards only). `what` says what it does ("start stream events"), for the log
        lines and the error, which names the server and what to do."""
        return await _outlast(
            step,
            patience=self._retry_reads_for,
            server=self._server,
            doing=what,
            transient=connection_lost,
            giving_up=lambda seconds, reason: DatabaseUnavailableError(
                f"could not {what}: PostgreSQL at {self._server} has been unreachable for "
                f"{seconds:.0f} s ({reason}). Check that the server is up and reachable at "
                "that address (host, port), or give it longer (database_patience in the "
                "configuration; retry_reads_for of Database.connect)"
            ),
            outage=self._outage,
        )

    @functools.cached_property
    def _server(self) -> str:
        return server_address(self._dsn)

    def _lost(self) -> None:
        """A connection died (under a statement, or while idle): its idle neighbours
        most likely did too (`_replace_lost` tests them before the next lease)."""
        self._lost_one = True
        self._connections_lost += 1
        self.wal_flushed = 0  # perhaps another server's WAL next (a failover)

    async def _replace_lost(self) -> None:
        """A connection was found dead: the server restarted, crashed or failed over,
        and the pool's idle connections (and the hot one) most likely died with it. Test
        them all now (a round trip each) and replace the dead ones, rather than let each
        lease find its own. One test at a time; leases meanwhile wait for it."""
        task = self._replacing
        if task is None or task.done():
            self._lost_one = False
            task = self._replacing = asyncio.create_task(
                self._test_idle_connections(), name="plait-pool-check"
            )
        await asyncio.shield(task)

    async def _test_idle_connections(self) -> None:
        hot = self._hot
        if hot is not None and not self._hot_busy:
            self._hot = None
            await self._pool.putconn(hot)  # tested with the pool's own
        try:
            await self._pool.check()
        except Exception as err:  # the leases find out for themselves
            logger.debug("testing the pool's idle connections failed: %s", err)

    async def _close_on_shutdown(self) -> None:
        """Wait until cancelled; then close the pool unless `close()` did.

        `asyncio.run` cancels every task left when its coroutine ends (also when it
        raised, or on Ctrl-C) and waits for all of them. A psycopg-pool worker that is
        reconnecting when cancelled swallows the cancellation and then waits on its
        queue forever, so the process would never exit and never print its error
        (seen after a PostgreSQL restart). Closing the pool sends each worker its stop
        message. A Database left unclosed thus still ends with its event loop."""
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            if not self._closed:
                self._closed = True
                await self._pool.close()

    async def run_schema(self, statements: str) -> None:
        """An application's own idempotent DDL (`CREATE TABLE IF NOT EXISTS ...`), under
        the migration lock, so processes starting together never race on it."""
        async with self.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            await conn.execute(statements)

    async def migrate(self, report: Callable[[str], None] | None = None) -> None:
        """Create or update plait's own tables (idempotent, safe to run concurrently).

        `report` gets a line per step (the `plait migrate` command prints them); they are
        logged either way."""

        def say(line: str) -> None:
            logger.info("%s", line)
            if report is not None:
                report(line)

        async with self.connection() as conn, conn.transaction():
            cur = await conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            got = await cur.fetchone()
            if not (got and got[0]):
                say("another process is migrating plait's schema; waiting for it")
                await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS plait_schema_version ("
                " version INTEGER PRIMARY KEY, description TEXT NOT NULL,"
                " applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
            )
            cur = await conn.execute("SELECT COALESCE(MAX(version), 0) FROM plait_schema_version")
            row = await cur.fetchone()
            current = row[0] if row else 0
            if current > LATEST:
                raise DatabaseUnavailableError(
                    f"the database's plait schema is version {current}, newer than this plait "
                    f"({LATEST}); upgrade plait before connecting it to this database"
                )
            todo = [m for m in MIGRATIONS if m[0] > current]
            if not todo:
                if report is not None:
                    report(f"plait schema is at version {current}, the latest: nothing to do")
                return
            say(f"plait schema is at version {current}; applying {len(todo)} migration(s)")
            for step, (version, description, statements) in enumerate(todo, 1):
                started = time.monotonic()
                await conn.execute(statements)
                await conn.execute(
                    "INSERT INTO plait_schema_version (version, description) VALUES (%s, %s)",
                    (version, description),
                )
                say(
                    f"[{step}/{len(todo)}] migration {version}: {description} "
                    f"({time.monotonic() - started:.2f} s)"
                )
        say(f"plait schema is now at version {LATEST}")

    # -- instance map: compact ids for writer names in tokens -------------------------------

    async def get_instance_ids(self, names: list[str]) -> dict[str, int]:
        """Compact ids of `names`, registering new names (select first, insert if missing)."""
        missing = sorted({n for n in names if n not in self._instance_ids})
        if missing:
            async with self.connection() as conn:
                await self._load_instances(conn, "instance_name = ANY(%s)", missing)
                for name in missing:
                    if name in self._instance_ids:
                        continue
                    await conn.execute(
                        "INSERT INTO instance_map (instance_name) VALUES (%s)"
                        " ON CONFLICT (instance_name) DO NOTHING",
                        (name,),
                    )
                await self._load_instances(conn, "instance_name = ANY(%s)", missing)
        return {n: self._instance_ids[n] for n in names}

    async def get_instance_names(self, ids: list[int]) -> dict[int, str]:
        """Names of the known ids among `ids` (unknown ids are left out)."""
        missing = sorted({i for i in ids if i not in self._instance_names})
        if missing:
            async with self.connection() as conn:
                await self._load_instances(conn, "instance_id = ANY(%s)", missing)
        return {i: self._instance_names[i] for i in ids if i in self._instance_names}

    async def _load_instances(
        self, conn: AsyncConnection[TupleRow], where: str, values: list[Any]
    ) -> None:
        cur = await conn.execute(
            f"SELECT instance_id, instance_name FROM instance_map WHERE {where}", (values,)
        )
        for instance_id, name in await cur.fetchall():
            self._instance_ids[name] = instance_id
            self._instance_names[instance_id] = name

    # -- sequence heads: what this process knows was handed out ------------------------

    def known_head(self, sequence: str) -> int:
        """The largest ID (internal domain) this process knows `sequence` has handed
        out: what its generators took, and the heads they read. A position at or below
        it names an ID; one above it must be checked against the sequence before a
        writer takes it (R-ID-14). Shared by every generator on this Database."""
        return self._identity.heads.get(sequence, 0)

    def note_head(self, sequence: str, head: int, *, heard: bool = False) -> None:
        """`sequence` has handed out `head` (internal domain) at least.

        `heard`: another process says so (a position it replicated), not PostgreSQL.
        Such a head may be an ID a crash took the sequence back below, said before the
        crash and heard only after this process's new connections caught up the heads
        it knew then. So one heard within `HEARD_AFTER_RESTART` of a new connection
        finding the server restarted is caught up before the next statement (`_Lease`).
        Heads read from PostgreSQL need no check: a committed row or a stored position
        reached the WAL after the sequence's log record that covers it."""
        identity = self._identity
        heads = identity.heads
        if head > heads.get(sequence, 0):
            heads[sequence] = head
            since = identity.restarted_at
            if heard and since is not None and time.monotonic() - since < HEARD_AFTER_RESTART:
                identity.heard[sequence] = head

    # -- lifetime ------------------------------------------------------------------------

    def registered(self, stream: str) -> None:
        """This run registered its epoch on `stream`: a later run that registers there
        supersedes it (its next new connection fails with `SupersededError`)."""
        self._identity.registered.add(stream)

    @property
    def patience(self) -> float:
        """Seconds plait waits for an unreachable server (`retry_reads_for`)."""
        return self._retry_reads_for

    def on_superseded(self, listener: Callable[[], None]) -> None:
        """Call `listener` once, when a later run of this instance has registered (this
        run may then write nothing more, and must not speak for the instance)."""
        self._identity.superseded.append(listener)

    @property
    def superseded(self) -> bool:
        return isinstance(self._identity.fenced, SupersededError)

    @property
    def fenced(self) -> bool:
        """Whether a connection found this run fenced, and it has not gone on as a new
        incarnation since (it does once none of its IDs is pending, `hold_renewal`)."""
        return self._identity.fenced is not None

    def hold_renewal(self, pending: Callable[[], bool]) -> None:
        """While `pending()` is true (IDs of this run not finished), a fenced run does
        not go on as a new incarnation (see `_Identity`)."""
        self._identity.holds.append(pending)

    def release_renewal(self, pending: Callable[[], bool]) -> None:
        if pending in self._identity.holds:
            self._identity.holds.remove(pending)

    def on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Run `closer` when the database closes (generators stop their tasks this way)."""
        self._closers.append(closer)

    def forget_on_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        if closer in self._closers:
            self._closers.remove(closer)

    async def close(self) -> None:
        """Stop what uses the pool, close the pool, and release the embedded server."""
        if self._closed:
            return
        self._closed = True
        for closer in reversed(self._closers):
            try:
                await closer()
            except Exception:
                logger.exception("error while closing %r", closer)
        self._closers.clear()
        replacing = self._replacing
        if replacing is not None and not replacing.done():
            # psycopg-pool's check may swallow the cancellation: it then ends after
            # testing the connections it holds, a round trip each.
            replacing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replacing
        hot, self._hot = self._hot, None
        if hot is not None and not self._hot_busy:
            await self._pool.putconn(hot)
        await self._pool.close()
        self._guard.cancel()
        if self._embedded is not None:
            await asyncio.to_thread(self._embedded.release)

    async def __aenter__(self) -> Database:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _probe(dsn: str, client: Mapping[str, Any]) -> bool:
    """Connect once to turn a bad DSN, an old server or a pooler plait cannot work
    behind into one clear error. Returns whether a (session) pooler is in between."""
    check_dsn(dsn)
    try:
        conn = await AsyncConnection.connect(
            dsn, **{**client, "connect_timeout": 10, "autocommit": True}
        )
    except psycopg.ProgrammingError as err:
        raise invalid_dsn(dsn, err) from None
    except psycopg.OperationalError as err:
        if may_come_up(err):
            raise  # `connect` tries again while it may wait, then says so
        raise cannot_connect(dsn, reason_of(err)) from None
    try:
        version = conn.info.server_version
        if version < MIN_SERVER_VERSION:
            raise DatabaseUnavailableError(
                f"PostgreSQL {version // 10000} at {redact(dsn)} is too old: plait needs 14 "
                "or newer"
            )
        return await _refuse_pooling_per_transaction(conn, dsn, client)
    finally:
        await conn.close()


async def _backend_pid(conn: AsyncConnection[Any]) -> int:
    row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
    assert row is not None
    return int(row[0])


async def _refuse_pooling_per_transaction(
    conn: AsyncConnection[Any], dsn: str, client: Mapping[str, Any]
) -> bool:
    """Whether a connection pooler sits between plait and the server; refuse one that
    lends server processes per transaction or per statement (PgBouncer's
    `pool_mode = transaction` or `statement`).

    plait fences a dead writer by proving that no server process carries its run's name
    (`incarnation.py`): that holds only if each of its connections keeps one server
    process, named after it, for the connection's life. Behind such a pooler an idle
    writer holds no process at all, its name lingers on processes now serving others,
    and settings, advisory locks and prepared statements land on whichever process
    serves the next transaction: the proof would fence live writers.

    A direct connection is told the real process id at login; a pooler makes up its
    own, so one round trip (`pg_backend_pid()`) tells them apart. Only then, a second
    client asks once and this connection twice more: under session pooling this one
    keeps its process and the other never gets it; lending per transaction, PgBouncer
    hands out its idle processes last-used first (the other client gets this one's) or,
    with `server_round_robin`, in turn (this connection moves on). Other clients busy on
    the same pool at that moment may hide a lending pooler (it is then not refused);
    a session pooler is never refused. A pooler that passes the server's own process id
    on at login is taken for a direct connection."""
    first = await _backend_pid(conn)
    if first == conn.info.backend_pid:
        return False
    other = await AsyncConnection.connect(
        dsn, **{**client, "connect_timeout": 10, "autocommit": True}
    )
    try:
        lent = await _backend_pid(other)
    finally:
        await other.close()
    if lent == first:
        seen = f"server process {first} served two client connections"
    else:
        later = [await _backend_pid(conn) for _ in range(2)]
        moved = next((pid for pid in later if pid != first), None)
        if moved is None:
            return True  # kept its process: session pooling
        seen = f"one client connection was served by server processes {first} and {moved}"
    raise DatabaseUnavailableError(
        f"PostgreSQL at {redact(dsn)} is reached through a connection pooler that lends "
        f"server connections per transaction or per statement ({seen}): plait needs "
        "session pooling (PgBouncer's pool_mode = session) or a direct connection, because "
        "it fences a dead writer by proving that none of its server processes is alive, "
        "and keeps settings and locks on its connections"
    )


def connection_lost(err: psycopg.OperationalError) -> bool:
    """Whether `err` says the connection or the server went away (and a read may be
    tried again on a new connection), not that the statement itself failed."""
    if isinstance(err, PoolTimeout):
        return True  # no connection to be had within the pool's timeout
    sqlstate = err.sqlstate
    # No SQLSTATE: libpq's own errors (the server closed the connection, connection
    # refused, the connection is closed). Class 08: connection exceptions.
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in _SERVER_WENT_AWAY


def may_come_up(err: psycopg.OperationalError) -> bool:
    """Whether a failed connection attempt may succeed later with nothing changed: no
    server answered (refused, timed out, no socket yet, a name not resolved yet), or
    one answered that it is starting, stopping, recovering or full. One that refused
    us for good (a wrong password, user or database name, no pg_hba.conf entry)
    answers FATAL with another reason."""
    if isinstance(err, PoolTimeout):
        return True
    text = str(err)
    if any(phrase in text for phrase in _REFUSED_FOR_GOOD):
        return False
    return "FATAL:" not in text or any(phrase in text for phrase in _NOT_ACCEPTING_YET)


CHECK_DSN = "Check host, port, user, password and database name"


def cannot_connect(
    dsn: str, reason: str, fix: str = f"{CHECK_DSN}, or pass dsn=None to use the embedded server"
) -> DatabaseUnavailableError:
    """No server answered at `dsn`, or it refused the connection: where, why, and `fix`
    (in the Python API's terms; the command line words its own from the fields)."""
    return DatabaseUnavailableError(
        f"could not connect to PostgreSQL at {redact(dsn)}: {reason}. {fix}",
        server=server_address(dsn),
        reason=reason,
    )


def connect_or_say(
    dsn: str, fix: str = f"{CHECK_DSN} of the DSN", **kwargs: Any
) -> psycopg.Connection[Any]:
    """A plain (synchronous) connection (`connect_sync`), or `cannot_connect`'s error
    saying where and why when there is none (not psycopg's, which may quote the DSN)."""
    check_dsn(dsn)
    try:
        return connect_sync(dsn, **kwargs)
    except psycopg.ProgrammingError as err:
        raise invalid_dsn(dsn, err) from None
    except psycopg.Error as err:
        raise cannot_connect(dsn, reason_of(err), fix) from None


def check_dsn(dsn: str) -> None:
    """Raise `InvalidDsnError` for a DSN libpq cannot parse, or whose port is not a
    number (psycopg would look it up as a service name and fail with a resolver's
    riddle, "Servname not supported for ai_socktype")."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as err:
        raise invalid_dsn(dsn, err) from None
    port = str(params.get("port") or "")
    if port and not all(part.strip().isdigit() for part in port.split(",")):
        raise invalid_dsn(dsn, f"the port {port!r} is not a number")


def invalid_dsn(dsn: str, err: psycopg.ProgrammingError | str) -> InvalidDsnError:
    """`dsn` is malformed: which DSN (no secrets) and what is wrong with it."""
    # libpq's message may quote the DSN back, password and all.
    reason = f"invalid DSN {redact(dsn)!r}: {redact(str(err).strip())}"
    return InvalidDsnError(
        f"{reason}. Use a URI such as postgresql://user@host:5432/dbname, or dsn=None "
        "for the embedded server",
        server=server_address(dsn),
        reason=reason,
    )


def reason_of(err: BaseException) -> str:
    """The first line of an error, without secrets: libpq's messages go on with hints
    over lines, and quote some DSNs back."""
    text = str(err).strip()
    if not text:
        return type(err).__name__
    # A name with several addresses: libpq says how each attempt failed, one per line
    # (::1 refused, then 127.0.0.1 refused the password); the last one is the verdict.
    attempts = [line.strip() for line in text.splitlines() if "failed:" in line]
    return redact(attempts[-1] if attempts else text.splitlines()[0])


def server_address(dsn: str) -> str:
    """Where the server is, for log lines and errors: host, port and database, no
    secrets."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return redact(dsn)
    # What the DSN leaves out, libpq takes from PGHOST, PGPORT, PGDATABASE and PGUSER,
    # then from its defaults: the local socket, 5432, the user's own name.
    env = os.environ
    host = (
        params.get("host")
        or params.get("hostaddr")
        or env.get("PGHOST")
        or env.get("PGHOSTADDR")
        or "localhost"
    )
    port = params.get("port") or env.get("PGPORT") or 5432
    user = params.get("user") or env.get("PGUSER") or getpass.getuser()
    dbname = params.get("dbname") or env.get("PGDATABASE") or user
    return f"{host}:{port}/{dbname}"


class _Outage:
    """When the server was first found unreachable, while it stays so: every waiter
    of one `Database` shares it, so an outage logs one warning, not one per reader."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None


async def _outlast(
    step: Callable[[], Awaitable[T]],
    *,
    patience: float,
    server: str,
    doing: str,
    transient: Callable[[psycopg.OperationalError], bool],
    giving_up: Callable[[float, str], DatabaseUnavailableError],
    outage: _Outage,
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
