"""plait behind a real PgBouncer (issue 18: poolers).

Session pooling keeps one server process per client connection for the connection's
life, which is all plait's fencing proof and session state need: it works, and a killed
writer behind it is fenced. Transaction and statement pooling lend server processes per
transaction or statement: `Database.connect` sees the server process change under one
connection and refuses with one line naming session pooling.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from psycopg.rows import TupleRow

import pace
from fence_helpers import LinearReader, committed, server_processes_gone, spawn, stop
from pgbouncer import PgBouncer, pgbouncer, pgbouncer_binary, role_with_schema
from plait import Database, DatabaseUnavailableError, FencedError
from plait.storage.incarnation import Incarnation, refuse_if_fenced
from plait.storage.stream_store import StreamStore
from plait.storage.timeouts import DatabaseTimeouts
from plait.storage.writer_rows import FenceResult
from stream_helpers import create_generator, create_table, spec_for

pytestmark = pytest.mark.skipif(
    pgbouncer_binary() is None,
    reason="pgbouncer is not installed (apt-get install pgbouncer); the PgBouncer tests need it",
)

INSERT = (
    "INSERT INTO events (stream_id, instance_name, payload)"
    " SELECT {id}, %s, 'p' || g FROM generate_series(1, %s) g RETURNING stream_id"
)


@pytest.fixture
def role(server_dsn: str) -> Iterator[str]:
    """A login role of its own, whose search_path is a fresh schema."""
    with role_with_schema(server_dsn) as name:
        yield name


@pytest.fixture
def session_bouncer(server_dsn: str, role: str) -> Iterator[PgBouncer]:
    with pgbouncer(server_dsn, "session", role) as bouncer:
        yield bouncer


def direct(server_dsn: str, role: str) -> str:
    """The role's DSN straight to the server, past PgBouncer."""
    return make_conninfo(server_dsn, user=role)


async def refused_with_one_line(dsn: str) -> str:
    try:
        db = await Database.connect(dsn, incarnation=Incarnation.new("w1"))
    except DatabaseUnavailableError as refused:
        message = str(refused)
    else:
        await db.close()
        pytest.fail("Database.connect accepted a pooler that lends server connections")
    print(message)
    assert "\n" not in message
    assert "pool_mode = session" in message
    assert "per transaction or per statement" in message
    assert "fences a dead writer" in message
    return message


@pytest.mark.parametrize("mode", ["transaction", "statement"])
async def test_pooling_per_transaction_or_statement_is_refused_with_one_line(
    server_dsn: str, role: str, mode: str
) -> None:
    with pgbouncer(server_dsn, mode, role) as bouncer:
        await refused_with_one_line(bouncer.dsn)


@pytest.mark.parametrize("round_robin", ["0", "1"])
async def test_lending_is_seen_with_idle_server_processes_in_either_order(
    server_dsn: str, role: str, round_robin: str
) -> None:
    """With several idle server processes, PgBouncer hands out the last used one first
    (the probe's second client gets the first one's) or, with server_round_robin, the
    oldest one (the first client moves on): either way the lending is seen."""
    with pgbouncer(server_dsn, "transaction", role, {"server_round_robin": round_robin}) as bouncer:
        held = [
            await psycopg.AsyncConnection.connect(bouncer.dsn, autocommit=True) for _ in range(3)
        ]
        for conn in held:  # three server processes at once
            await conn.execute("BEGIN; SELECT 1")
        for conn in held:  # then idle in PgBouncer's pool
            await conn.execute("COMMIT")
            await conn.close()
        message = await refused_with_one_line(bouncer.dsn)
    if round_robin == "1":
        assert "one client connection was served by server processes" in message
    else:
        assert "served two client connections" in message


async def test_a_direct_connection_is_not_taken_for_a_pooler(server_dsn: str) -> None:
    db = await Database.connect(server_dsn)
    try:
        async with db.connection() as conn:
            cursor = await conn.execute("SELECT pg_backend_pid()")
            assert await cursor.fetchone() == (conn.info.backend_pid,)
    finally:
        await db.close()


async def test_session_pooling_keeps_settings_names_and_statements(
    server_dsn: str, role: str, session_bouncer: PgBouncer
) -> None:
    run = Incarnation.new("w1")
    db = await Database.connect(
        session_bouncer.dsn,
        incarnation=run,
        timeouts=DatabaseTimeouts(idle_in_transaction_session_timeout=7.0),
    )
    watcher = await Database.connect(direct(server_dsn, role))
    try:
        await db.migrate()
        await create_table(db)
        # ensure_sequence takes a session-level advisory lock through PgBouncer.
        gen = await create_generator(db, ["w1", "w2"], "w1")
        ids = [i for _ in range(12) for i in await gen.insert(INSERT, ("w1", 2))]  # prepared
        assert len(set(ids)) == 24
        async with db.connection() as conn:
            # SET after connecting lasts: the timeouts' session settings are in force.
            shown = await conn.execute(
                "SELECT setting FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'"
            )
            assert await shown.fetchone() == ("7000",)
        store = StreamStore(watcher, spec_for(["w1", "w2"]))
        # The run's name reaches the server processes PgBouncer lends it: no fence.
        alive = await store.writers.fence("w1", ids[-1])
        assert alive.alive >= 1
        assert alive.position is None
        await gen.close()
        await db.close()
        # PgBouncer keeps the server processes, but its DISCARD ALL drops the name (once
        # it has run: PgBouncer resets a released server connection on its own time).
        fences: list[FenceResult] = []

        async def fenced() -> bool:
            fences.append(await store.writers.fence("w1", ids[-1]))
            return fences[-1].position is not None

        await pace.until(
            fenced, 10, "a fence of w1 once PgBouncer reset its connections", every=0.05
        )
        assert (fences[-1].alive, fences[-1].position) == (0, ids[-1])
        # The fenced run may open no new connection through PgBouncer either.
        async with await psycopg.AsyncConnection.connect(
            session_bouncer.dsn, autocommit=True, application_name=run.application_name
        ) as conn:
            with pytest.raises(FencedError):
                await refuse_if_fenced(conn, run)
    finally:
        await db.close()
        await watcher.close()


class _Probe:
    """A statement sent with COMMIT (`Transaction.send_with_commit`)."""

    def statement(self) -> tuple[str, Any]:
        return "SELECT 1", None

    def sending(self) -> None:
        pass

    def committed(self, columns: list[str] | None, records: list[TupleRow] | None) -> None:
        pass

    def failed(self) -> None:
        pass


async def test_a_commit_names_the_server_process_behind_the_pooler(
    session_bouncer: PgBouncer,
) -> None:
    """A COMMIT whose connection broke is waited out by the server process's id: behind
    PgBouncer, the id the client was given at login is PgBouncer's, not the server's."""
    db = await Database.connect(session_bouncer.dsn)
    try:
        async with db.transaction() as txn:
            conn = await txn.connection()
            row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
            assert row is not None
            assert row[0] != conn.info.backend_pid  # PgBouncer's own number
            txn.send_with_commit(_Probe())
        assert txn.backend_pid == row[0]
    finally:
        await db.close()


async def test_killed_writers_behind_session_pooling_are_fenced_up_to_the_last_row(
    server_dsn: str, role: str, session_bouncer: PgBouncer
) -> None:
    """w1 is killed and fenced while w2 writes on, then w2 is killed too: the reader
    fences both and reaches the last committed row. The second fence used to never come
    in about one run in twenty: the fenced w1, due again on every tick, was always tried
    first and starved w2 (`HoldWatch.candidate`); PgBouncer kept nothing of w2 alive."""
    dsn = session_bouncer.dsn
    db = await Database.connect(dsn)
    await db.migrate()
    await create_table(db)
    reader_db = await Database.connect(dsn, incarnation=Incarnation.new("reader"))
    reader_gen = await create_generator(
        reader_db, ["w1", "w2"], "reader", position_flush_interval=0.1, fence_after=1.0
    )
    reader = LinearReader(reader_gen)
    writers = {name: await spawn(dsn, name) for name in ("w1", "w2")}
    try:
        await asyncio.sleep(0.5)  # both write, four transactions at a time each
        writers["w1"].send_signal(signal.SIGKILL)
        await writers["w1"].wait()
        head = await reader.gen.get_max_allocated_token()
        # Generous: PgBouncer sees the client go at once, fence_after is 1 s.
        try:
            took = await reader.until(head, within=15.0)
        except TimeoutError as late:
            pytest.fail(f"the linear position did not pass the dead writer's IDs: {late}")
        print(f"linear position passed the dead writer {took:.2f} s after kill -9")
        killed = time.monotonic()
        stop(*writers.values())
        for process in writers.values():
            await process.wait()
        # Both dead: w2 is fenced up to its own last committed row, w1 follows. The
        # sequence may have handed out IDs above it that were rolled back: no position
        # ever passes those, so the last committed row is what the reader can reach.
        await server_processes_gone(db, ["w1", "w2"], within=30.0)
        truth = await committed(db)
        last = truth[-1][0]
        try:  # about fence_after and a few ticks; generous for a busy machine
            await reader.until(last, within=30.0)
        except TimeoutError as late:
            pytest.fail(
                f"the linear position did not reach the last committed row after both"
                f" writers were killed, waiting for it to fence the second one: {late}"
                f" (positions {reader.gen.get_positions()})"
            )
        took = time.monotonic() - killed
        print(f"linear position reached the last row {took:.2f} s after both were killed")
        assert sorted(reader.seen) == truth  # every committed row once, nothing else
        assert {w for _, w in truth} == {"w1", "w2"}
    finally:
        stop(*writers.values())
        await reader_gen.close()
        await reader_db.close()
        await db.close()
