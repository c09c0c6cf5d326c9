"""Database: the connection lent between pool checkouts never leaks state between users."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from psycopg import pq

import pace
from plait import Database
from plait.storage import identity, server_errors

IDLE = pq.TransactionStatus.IDLE


async def backend_pid(db: Database) -> int:
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
    assert row is not None
    return int(row[0])


async def test_the_same_connection_serves_one_statement_after_another(db: Database) -> None:
    assert await backend_pid(db) == await backend_pid(db)


async def test_nested_and_concurrent_users_get_their_own_connections(db: Database) -> None:
    async with db.connection() as outer, db.connection() as inner:
        assert outer is not inner
    everyone_holds_one = asyncio.Barrier(5)

    async def hold() -> int:
        async with db.connection() as conn:
            row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
            await everyone_holds_one.wait()  # all five connections are out at once
        assert row is not None
        return int(row[0])

    pids = await asyncio.gather(*(hold() for _ in range(5)))
    assert len(set(pids)) == 5


async def test_a_transaction_left_open_does_not_reach_the_next_user(db: Database) -> None:
    async with db.connection() as conn:
        await conn.execute("BEGIN")
        await conn.execute("CREATE TEMP TABLE leftover (x int)")
    async with db.connection() as conn:
        assert conn.info.transaction_status == IDLE
        row = await (await conn.execute("SELECT to_regclass('leftover')")).fetchone()
        assert row == (None,)  # the open transaction was rolled back, not committed


async def test_an_error_recycles_the_connection(db: Database) -> None:
    async def fail_inside_a_transaction() -> None:
        async with db.connection() as conn:
            await conn.execute("BEGIN")
            await conn.execute("CREATE TEMP TABLE aborted (x int)")
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        await fail_inside_a_transaction()
    async with db.connection() as conn:
        assert conn.info.transaction_status == IDLE
        row = await (await conn.execute("SELECT to_regclass('aborted')")).fetchone()
        assert row == (None,)


async def test_close_while_a_connection_is_lent(dsn: str) -> None:
    db = await Database.connect(dsn)
    async with db.connection() as conn:
        await db.close()
        assert not conn.closed  # the borrower finishes its work...
    assert conn.closed  # ...and the connection is closed when it comes back


async def test_cursor_is_reused_on_the_free_connection_only(db: Database) -> None:
    async with db.scalar_cursor() as first:
        await first.execute("SELECT 1")
        assert await first.fetchall() == [1]  # rows are first-column values
        async with db.scalar_cursor() as meanwhile:  # the hot connection is busy: another one
            assert meanwhile is not first
            assert meanwhile.connection is not first.connection
            await meanwhile.execute("SELECT 2")
            assert await meanwhile.fetchall() == [2]
    async with db.scalar_cursor() as again:
        assert again is first

    async def fail() -> None:
        async with db.scalar_cursor() as cur:
            await cur.execute("SELECT 1/0")

    with pytest.raises(psycopg.errors.DivisionByZero):
        await fail()
    async with db.scalar_cursor() as after:  # the connection was recycled, and its cursor too
        assert after is not first
        await after.execute("SELECT 3")
        assert await after.fetchall() == [3]
        assert after.connection.info.transaction_status == IDLE


@pytest.mark.parametrize(
    ("message", "transient"),
    [
        (
            'connection failed: connection to server at "127.0.0.1", port 1 failed: '
            "Connection refused",
            True,
        ),
        ("connection failed: FATAL:  the database system is starting up", True),
        ('connection failed: FATAL:  password authentication failed for user "x"', False),
        ("connection failed: fe_sendauth: no password supplied", False),
        ("connection failed: SSL error: certificate verify failed", False),
        ("connection failed: server does not support SSL, but SSL was required", False),
    ],
)
def test_only_a_server_thatmay_come_up_is_waited_for(message: str, transient: bool) -> None:
    """A refusal no wait can change (a password, SSL settings) fails at once, with its
    own reason, instead of after the patience with advice to wait longer."""
    assert server_errors.may_come_up(psycopg.OperationalError(message)) is transient


async def test_no_connection_within_the_pools_timeout_is_plaits_error(dsn: str) -> None:
    """Every connection busy (or a server that does not answer): psycopg_pool's bare
    PoolTimeout reached the caller; now plait's NoConnectionError, which names the
    server and what to do, and is still a PoolTimeout for code that caught that."""
    from psycopg_pool import PoolTimeout

    from plait import DatabaseUnavailableError, NoConnectionError, PlaitError

    db = await Database.connect(dsn, min_size=1, max_size=1)
    db._conns.pool.timeout = 0.5  # psycopg_pool's own default is 30 s
    try:
        async with db.connection():
            with pytest.raises(NoConnectionError, match=r"within 0.5 s.*\(1 at most\)") as err:
                async with db.connection():
                    pass
        assert isinstance(err.value, DatabaseUnavailableError)
        assert isinstance(err.value, PlaitError)
        assert isinstance(err.value, PoolTimeout)
        assert server_errors.server_address(db.dsn) in str(err.value)
    finally:
        await db.close()


async def test_a_head_heard_is_taken_as_said_unless_postgresql_just_restarted(
    dsn: str,
) -> None:
    """A head another process tells of (`note_head(heard=True)`) is caught up before the
    next statement only soon after a new connection found the server restarted, when it
    may name an ID a crash took back (test_pg_crash_writers.py does the crash). A lost
    connection alone is no restart: the sequence is left where it is, at no cost.

    One connection at most: two new connections catching up at once may each take the
    values (harmless, IDs without rows), which would make the heads below inexact."""
    db = await Database.connect(dsn, min_size=1, max_size=1)
    try:
        await _heard_head_checks(db)
    finally:
        await db.close()


async def _heard_head_checks(db: Database) -> None:
    async with db.connection() as conn:
        await conn.execute("DROP SEQUENCE IF EXISTS heard_seq")
        await conn.execute("CREATE SEQUENCE heard_seq")
        await conn.execute("SELECT setval('heard_seq', 10)")

    async def head() -> int:
        async with db.connection() as conn:
            row = await (await conn.execute("SELECT last_value FROM heard_seq")).fetchone()
            assert row is not None
            return int(row[0])

    db.note_head("heard_seq", 12)
    assert await head() == 10  # known, on connections made before: nothing to do
    with pytest.raises(psycopg.OperationalError):
        async with db.connection() as conn:
            await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    assert db.connections_lost == 1
    assert await head() == 12  # a new connection catches up every head known
    db.note_head("heard_seq", 20, heard=True)  # the server did not restart
    assert await head() == 12
    async with db.connection() as conn:
        await conn.execute("DROP SEQUENCE heard_seq")


async def test_new_connections_bring_a_sequence_that_went_back_up_to_what_was_handed_out(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """What a crash does to a sequence (test_pg_crash_writers.py does the crash): on each
    new connection, a sequence below the largest ID this process saw it hand out is
    moved up with nextval first, whatever the case of its name. Left alone, and the
    connection still serves: a sequence dropped since, one never called or reset with
    setval(..., false) (no head to compare), and one further behind than a crash takes
    it (reset: said once, not on every connection)."""
    names = ["went_back_seq", "Went_Back_Seq", "never_called_seq", "reset_far_seq"]
    async with db.connection() as conn:
        for name in names:
            await conn.execute(f'DROP SEQUENCE IF EXISTS "{name}"')
            await conn.execute(f'CREATE SEQUENCE "{name}"')
        await conn.execute("SELECT setval('went_back_seq', 10)")
        await conn.execute("""SELECT setval('"Went_Back_Seq"', 10)""")
        await conn.execute("SELECT setval('reset_far_seq', 1)")
    db.note_head("went_back_seq", 25)
    db.note_head("Went_Back_Seq", 12)
    db.note_head("never_called_seq", 7)
    db.note_head("reset_far_seq", 1 + identity.SEQUENCE_CATCH_UP_LIMIT + 1)
    db.note_head("dropped_since_seq", 7)

    async def nested(depth: int) -> None:  # more at once than the pool has: new ones
        async with db.connection() as conn:
            assert await (await conn.execute("SELECT 1")).fetchone() == (1,)
            if depth:
                await nested(depth - 1)

    await nested(4)
    async with db.connection() as conn:
        nexts = []
        for name in names:
            row = await (await conn.execute(f"""SELECT nextval('"{name}"')""")).fetchone()
            assert row is not None
            nexts.append(row[0])
            await conn.execute(f'DROP SEQUENCE "{name}"')
    assert nexts == [26, 13, 1, 2]
    assert "sequence went_back_seq was at 10, below ID 25" in caplog.text
    assert "sequence Went_Back_Seq was at 10, below ID 12" in caplog.text
    assert caplog.text.count("sequence reset_far_seq is at 1") == 1


async def test_a_notification_that_arrived_while_idle_still_reaches_notifies(dsn: str) -> None:
    """Each lease polls its connection for the server having ended it (after a restart:
    `test_pg_restart.py`). What else it reads there, such as a notification for a
    LISTEN the application keeps on the connection, must still reach psycopg's
    `notifies()`, which waits on the socket and would not see it otherwise."""
    db = await Database.connect(dsn, min_size=1, max_size=1)
    try:
        async with db.connection() as conn:
            await conn.execute("LISTEN plait_idle_check")
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other:
            await other.execute("NOTIFY plait_idle_check, 'hello'")
        await asyncio.sleep(0.2)  # delivered to the idle connection
        async with db.connection() as conn:  # the lease polls, and reads it
            got = [n.payload async for n in conn.notifies(timeout=5, stop_after=1)]
            await conn.execute("UNLISTEN plait_idle_check")
        assert got == ["hello"]
    finally:
        await db.close()


class HoldsTheEnd:
    """A TCP proxy to PostgreSQL that passes bytes both ways at once, but lets its
    client hear that the server ended the connection only `delay` s later: the
    server's last words (FATAL) have arrived, the end of the stream not yet (a busy
    network or host can part them)."""

    def __init__(self, host: str, port: int, delay: float) -> None:
        self._target = (host, port)
        self._delay = delay
        self.server_ended = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(*self._target)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, late: bool) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
                if late:
                    self.server_ended.set()
                    await asyncio.sleep(self._delay)
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        for task in (
            asyncio.create_task(pipe(client_r, server_w, late=False)),
            asyncio.create_task(pipe(server_r, client_w, late=True)),
        ):
            self._tasks.add(task)


async def test_a_connection_whose_server_said_fatal_is_not_used_before_its_end_arrives(
    dsn: str,
) -> None:
    """The idle check also takes the server's FATAL (read while idle: libpq hands it to
    the notice handler) as the end, without waiting for the end of the stream. Before,
    the lease handed the connection out, and the statement failed with
    OperationalError once the end arrived."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    slow = pace.slowness()  # the held end, and the bound below it, at this machine's pace
    proxy = HoldsTheEnd(
        str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432), 5.0 * slow
    )
    port = await proxy.start()
    db = await Database.connect(
        psycopg.conninfo.make_conninfo(dsn, host="127.0.0.1", port=port), min_size=1, max_size=1
    )
    try:
        async with db.connection() as conn:
            row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
        assert row is not None
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other:
            await other.execute("SELECT pg_terminate_backend(%s)", (row[0],))
        async with pace.within(10, "the server to end the terminated connection"):
            await proxy.server_ended.wait()
        await asyncio.sleep(0.1)  # the FATAL reached the idle connection's socket
        try:  # not the held end's 5 s (both at this machine's pace)
            async with pace.bounded(4.0 * slow, "SELECT 1"), db.connection() as conn:
                await conn.execute("SELECT 1")
        except TimeoutError as late:
            pytest.fail(f"{late}: the lease handed out the ended connection")
        assert db.connections_lost >= 1
    finally:
        await db.close()
        await proxy.close()
