"""`Database`: the connection pool, migrations, the instance map, and what every stream
of a process shares (known sequence heads, the run's identity, retries through an
outage). Where each statement's connection comes from is `leases.py`; transactions are
`transaction.py`; what a new connection is told and checks, `identity.py`; SQL about one
stream, `stream_store.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection, AsyncCursor
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool

from plait.errors import (
    ConfigError,
    DatabaseUnavailableError,
    SupersededError,
)
from plait.storage.embedded import EmbeddedPostgres
from plait.storage.identity import HEARD_AFTER_RESTART, Identity
from plait.storage.incarnation import (
    Incarnation,
)
from plait.storage.leases import RECONNECT_CHAIN, Connections, CursorLease, Lease
from plait.storage.migrations import LATEST, MIGRATION_LOCK, MIGRATIONS
from plait.storage.outages import Outage, outlast
from plait.storage.probe import probe
from plait.storage.server_errors import cannot_connect, connection_lost, may_come_up, server_address
from plait.storage.timeouts import DEFAULT_TIMEOUTS, DatabaseTimeouts
from plait.storage.transaction import Transaction, WalProgress

logger = logging.getLogger(__name__)

MIN_SERVER_VERSION = 140000
# How long plait waits for a server that went away or is not up yet (a restart takes
# seconds, a crash's recovery tens of them) before it fails with
# DatabaseUnavailableError: its own reads, and an `Instance`'s start-up (the
# configuration's `database_patience`).
DEFAULT_RETRY_READS_FOR = 60.0

T = TypeVar("T")


class Database:
    """A psycopg 3 async pool on PostgreSQL 14+, or on the embedded server."""

    def __init__(
        self,
        pool: AsyncConnectionPool[AsyncConnection[TupleRow]],
        dsn: str,
        embedded: EmbeddedPostgres | None,
        identity: Identity | None = None,
        *,
        retry_reads_for: float = DEFAULT_RETRY_READS_FOR,
    ) -> None:
        self._dsn = dsn
        self._embedded = embedded
        self._instance_ids: dict[str, int] = {}
        self._instance_names: dict[int, str] = {}
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._identity = identity or Identity()
        self._retry_reads_for = retry_reads_for
        self._outage = Outage()  # one warning per outage, not per reader
        # How far PostgreSQL's WAL is known to be on disk, and who wants to know (R-ID-14).
        self.wal = WalProgress()
        self._conns = Connections(pool, self._identity, server_address(dsn), self._lost)
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
        identity = Identity(incarnation, timeouts.session_settings(dsn))
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
            identity.pooled = await probe(dsn, client)
            pool: AsyncConnectionPool[AsyncConnection[TupleRow]] = AsyncConnectionPool(
                dsn,
                min_size=min_size,
                max_size=max_size,
                kwargs=kwargs,
                configure=identity.configure,
                open=False,
                name="plait",
                reconnect_timeout=RECONNECT_CHAIN,
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
            pool = await outlast(
                open_pool,
                patience=wait_for_server,
                server=server_address(dsn),
                doing="connect",
                transient=may_come_up,
                giving_up=unreachable,
                outage=Outage(),
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
        return self._conns.lost_count

    def connection(self) -> AbstractAsyncContextManager[AsyncConnection[TupleRow]]:
        """A pooled connection in autocommit mode."""
        return Lease(self._conns)

    def scalar_cursor(self) -> AbstractAsyncContextManager[AsyncCursor[Any]]:
        """A cursor on a pooled connection in autocommit mode, for plait's own hot
        statements: its rows are the first column's values (`scalar_row`); read them
        inside the block (the next user reuses the cursor)."""
        return CursorLease(self._conns)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        """A transaction; committed when the block exits normally, else rolled back.

        COMMIT and ROLLBACK run to completion even if the calling task is cancelled
        meanwhile: callbacks must know how the transaction ended.
        """
        async with (
            self.connection() as conn,
            Transaction(conn, self.wal, self.wait_finished) as txn,
        ):
            yield txn

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
        return await outlast(
            step,
            patience=self._retry_reads_for,
            server=self._conns.server,
            doing=what,
            transient=connection_lost,
            giving_up=lambda seconds, reason: DatabaseUnavailableError(
                f"could not {what}: PostgreSQL at {self._conns.server} has been unreachable for "
                f"{seconds:.0f} s ({reason}). Check that the server is up and reachable at "
                "that address (host, port), or give it longer (database_patience in the "
                "configuration; retry_reads_for of Database.connect)"
            ),
            outage=self._outage,
        )

    def _lost(self) -> None:
        """A connection died: perhaps another server's WAL next (a failover)."""
        self.wal.flushed = 0

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
            conns = self._conns
            if not conns.closed:
                # Only the pool: its workers' stop messages are what shutdown needs; the
                # event loop is ending, so nothing is handed back or waited out.
                conns.closed = True
                await conns.pool.close()

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
        finding the server restarted is caught up before the next statement (`leases.Lease`).
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
        not go on as a new incarnation (see `identity.Identity`)."""
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
        if self._conns.closed:
            return
        self._conns.closed = True  # leases from here on use the pool only
        for closer in reversed(self._closers):
            try:
                await closer()
            except Exception:
                logger.exception("error while closing %r", closer)
        self._closers.clear()
        await self._conns.close()
        self._guard.cancel()
        if self._embedded is not None:
            await asyncio.to_thread(self._embedded.release)

    async def __aenter__(self) -> Database:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
