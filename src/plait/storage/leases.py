"""Where a statement's connection comes from: the hot connection while it is free, else
one from the pool, each tested before use for a server that ended it while idle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection, AsyncCursor, pq
from psycopg.rows import TupleRow, scalar_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from plait.errors import (
    NoConnectionError,
)
from plait.storage.identity import Identity
from plait.storage.server_errors import connection_lost

logger = logging.getLogger(__name__)

T = TypeVar("T")
_IDLE = pq.TransactionStatus.IDLE


class Connections:
    """A pool and the hot connection beside it: what the leases take connections from.

    One connection is kept out of the pool and lent to whoever needs a connection while
    it is free: a pool checkout costs about as much client CPU as a small statement
    does, and most of plait's work is one statement at a time. `Database` owns one and
    closes it; the leases below use it, and nothing else does."""

    __slots__ = (
        "_replacing",
        "closed",
        "hot",
        "hot_busy",
        "hot_cursor",
        "identity",
        "lost_count",
        "lost_one",
        "on_lost",
        "pool",
        "server",
    )

    def __init__(
        self,
        pool: AsyncConnectionPool[AsyncConnection[TupleRow]],
        identity: Identity,
        server: str,
        on_lost: Callable[[], None],
    ) -> None:
        self.pool = pool
        self.identity = identity
        self.server = server  # where, for errors (`server_address`)
        self.on_lost = on_lost  # told of each connection found dead
        self.hot: AsyncConnection[TupleRow] | None = None
        self.hot_busy = False
        self.hot_cursor: AsyncCursor[Any] | None = None
        self.closed = False
        # Set when a connection was found dead (`lost`): the next lease first tests the
        # idle connections (`replace_lost`).
        self.lost_one = False
        self.lost_count = 0
        self._replacing: asyncio.Task[None] | None = None

    def lost(self) -> None:
        """A connection died (under a statement, or while idle): its idle neighbours
        most likely did too (`replace_lost` tests them before the next lease)."""
        self.lost_one = True
        self.lost_count += 1
        self.on_lost()

    async def replace_lost(self) -> None:
        """A connection was found dead: the server restarted, crashed or failed over,
        and the pool's idle connections (and the hot one) most likely died with it. Test
        them all now (a round trip each) and replace the dead ones, rather than let each
        lease find its own. One test at a time; leases meanwhile wait for it."""
        task = self._replacing
        if task is None or task.done():
            self.lost_one = False
            task = self._replacing = asyncio.create_task(
                self._test_idle_connections(), name="plait-pool-check"
            )
        await asyncio.shield(task)

    async def close(self) -> None:
        """Close the pool, and the hot connection with it. `closed` is set first (the
        owner may set it earlier): leases from then on use the pool only."""
        self.closed = True
        replacing = self._replacing
        if replacing is not None and not replacing.done():
            # psycopg-pool's check may swallow the cancellation: it then ends after
            # testing the connections it holds, a round trip each.
            replacing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replacing
        hot, self.hot = self.hot, None
        if hot is not None and not self.hot_busy:
            await self.pool.putconn(hot)
        await self.pool.close()

    async def _test_idle_connections(self) -> None:
        hot = self.hot
        if hot is not None and not self.hot_busy:
            self.hot = None
            await self.pool.putconn(hot)  # tested with the pool's own
        try:
            await self.pool.check()
        except Exception as err:  # the leases find out for themselves
            logger.debug("testing the pool's idle connections failed: %s", err)


class Lease:
    """`Database.connection()`: the hot connection while it is free, else a pooled one.

    The hot connection is kept out of the pool because a pool checkout costs as much
    client CPU as a small statement. A class rather than a generator-based context
    manager for the same reason: it runs on every write. Any error, cancellation or
    transaction left open hands the hot connection back to the pool, which rolls it back
    or replaces it.
    """

    __slots__ = ("_conns", "hot", "pooled")

    def __init__(self, conns: Connections) -> None:
        self._conns = conns
        self.hot: AsyncConnection[TupleRow] | None = None  # the hot one, when it is lent
        self.pooled: AbstractAsyncContextManager[AsyncConnection[TupleRow]] | None = None

    async def __aenter__(self) -> AsyncConnection[TupleRow]:
        identity = self._conns.identity
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
        conns = self._conns
        if conns.lost_one and not conns.closed:
            await conns.replace_lost()
        if conns.hot_busy or conns.closed:
            return await _pooled_connection(conns, self)
        conns.hot_busy = True
        try:
            hot = conns.hot
            if hot is None or hot.closed:
                hot = conns.hot = await _waiting(conns, conns.pool.getconn)
        except BaseException:
            conns.hot_busy = False
            raise
        self.hot = hot
        return hot

    async def _drop(self, conn: AsyncConnection[TupleRow]) -> None:
        """Give back a connection found dead before use; the pool discards it. The
        lease lets go of it before the first await (a cancellation then leaks
        nothing); closed first, so that the pool's exit does not try to use it."""
        conns = self._conns
        conns.lost()
        pooled, self.pooled = self.pooled, None
        if pooled is None:
            self.hot = conns.hot = None
            conns.hot_busy = False
        await conn.close()
        if pooled is not None:
            await pooled.__aexit__(None, None, None)
        else:
            await conns.pool.putconn(conn)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conns = self._conns
        if isinstance(exc, psycopg.OperationalError) and connection_lost(exc):
            conns.lost()
        if self.pooled is not None:
            await self.pooled.__aexit__(exc_type, exc, tb)
            return
        hot = self.hot
        assert hot is not None
        try:
            if conns.closed:
                conns.hot = None
                await hot.close()  # the database closed while we were using it
            elif exc_type is not None or hot.pgconn.transaction_status != _IDLE:
                conns.hot = None
                await conns.pool.putconn(hot)
        finally:
            conns.hot_busy = False


# How many connections found dead before use a lease replaces before it hands out the
# next one anyway: after the first, the pool's idle ones are tested (`Connections.replace_lost`).
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
RECONNECT_CHAIN = 5.0
# While waiting for the pool, a lease looks again after this long, then after twice
# as long each time: whether the pool's connection attempts found this run fenced (then
# it fails at once, not after the pool's timeout), and to start a fresh reconnect chain.
# Doubling: each look puts the lease at the back of the pool's queue.
_FIRST_LOOK = 1.0


async def _waiting(conns: Connections, get: Callable[[float], Awaitable[T]]) -> T:
    """`get(timeout)` from the pool, up to the pool's own timeout, failing with
    `FencedError` as soon as a connection attempt found this run fenced."""
    identity, pool = conns.identity, conns.pool
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
                    f"no connection to PostgreSQL at {conns.server} within {pool.timeout:g} s: "
                    "the server did not answer, or every connection of the pool stayed busy "
                    f"({pool.max_size} at most): check that the server is up, and give the "
                    "pool more connections (max_size) or hold them for shorter"
                ) from None
            step *= 2


async def _pooled_connection(conns: Connections, lease: Lease) -> AsyncConnection[TupleRow]:
    async def enter(wait: float) -> AsyncConnection[TupleRow]:
        pooled = conns.pool.connection(timeout=wait)
        conn = await pooled.__aenter__()
        lease.pooled = pooled
        return conn

    return await _waiting(conns, enter)


class CursorLease:
    """`Database.scalar_cursor()`: on the hot connection, the same cursor every time (a new
    psycopg cursor per statement costs more client CPU than the rest of a small write);
    on a pooled connection, a new one. Rows are scalars (the first column)."""

    __slots__ = ("_conns", "_lease")

    def __init__(self, conns: Connections) -> None:
        self._conns = conns
        self._lease = Lease(conns)

    async def __aenter__(self) -> AsyncCursor[Any]:
        lease = self._lease
        conn = await lease.__aenter__()
        if lease.hot is None:
            return conn.cursor(row_factory=scalar_row)
        conns = self._conns
        cursor = conns.hot_cursor
        if cursor is None or cursor.connection is not conn:
            cursor = conns.hot_cursor = conn.cursor(row_factory=scalar_row)
        return cursor

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._lease.__aexit__(exc_type, exc, tb)
