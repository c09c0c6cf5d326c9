"""Issue 18, finding 2: a PostgreSQL crash fenced every live writer for good. The crash
killed their connections, so readers rightly fenced them; but each writer then answered
"was fenced ... must not write again: restart it". A live writer now goes on as a new
incarnation by itself, and its position never goes backwards through the fence."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import sys
from asyncio.subprocess import Process
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import pace
from pg_restarts import RestartablePostgres
from plait import Database, FencedError, MultiWriterIdGenerator, StreamSpec, TableSpec
from plait.check.proxy import CutProxy
from plait.errors import InstanceRunningError, SupersededError
from plait.ports import free_port
from plait.storage.incarnation import Incarnation

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
CRASH_WRITER = Path(__file__).with_name("crash_writer.py")


async def _w1_behind_a_proxy(server: RestartablePostgres) -> tuple[CutProxy, Database]:
    """A proxy in front of `server`, started, and a Database of instance w1 (a new
    incarnation) that reaches the server only through it: the test decides when w1 may
    connect."""
    proxy = CutProxy(free_port(), server.port)
    await proxy.start()
    db = await Database.connect(
        make_conninfo(server.dsn, port=str(proxy.port)),
        max_size=4,
        incarnation=Incarnation.new("w1"),
    )
    return proxy, db


async def _epoch_row(db: Database) -> tuple[int, int | None, object]:
    async with db.connection() as conn:
        cur = await conn.execute(
            "SELECT stream_id, epoch, fenced_at FROM stream_positions"
            " WHERE stream_name = 'events' AND instance_name = 'w1'"
        )
        row = await cur.fetchone()
    assert row is not None
    return int(row[0]), row[1], row[2]


async def test_a_writer_fenced_after_a_crash_goes_on_as_a_new_incarnation(
    restartable_pg: RestartablePostgres,
) -> None:
    server = restartable_pg
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=["w1"])
    setup = await Database.connect(server.dsn, max_size=2)
    await setup.migrate()
    async with setup.connection() as conn:
        await conn.execute(
            "CREATE TABLE events (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
            " payload TEXT); CREATE INDEX ON events (instance_name, stream_id)"
        )
    await setup.close()
    # w1 reaches the server through a proxy, so the test decides when it may connect
    # again: after the reader fenced it (else it may reconnect first, and rightly not
    # be fenced at all).
    proxy, w1_db = await _w1_behind_a_proxy(server)
    first = w1_db.incarnation
    assert first is not None
    w1 = await MultiWriterIdGenerator.create(w1_db, spec, "w1", position_flush_interval=0.1)
    reader_db = await Database.connect(server.dsn, max_size=4)
    reader = await MultiWriterIdGenerator.create(
        reader_db, spec, "reader", position_flush_interval=0.1, fence_after=0.3
    )
    insert = "INSERT INTO events VALUES ({id}, 'w1', %s) RETURNING stream_id"
    try:
        before = [await w1.insert(insert, (f"before{i}",)) for i in range(3)]
        await w1.flush_position()
        stored_before, epoch, _ = await _epoch_row(w1_db)
        assert epoch == first.epoch

        held = w1.get_next()  # an ID in flight when the server dies
        held_id = await held.__aenter__()
        await proxy.stop()  # w1 cannot reconnect...
        await asyncio.to_thread(_crash, server)
        await pace.until(
            lambda: reader.fences >= 1, 30, "the reader to fence w1 after the crash", every=0.05
        )
        await proxy.start()  # ...until now
        # While the ID taken before the fence is held, this run may not write: it
        # could commit that ID below where the fence moved the readers.
        # (A connection the pool kept from before the crash fails first, with the
        # crash's own error; the next one is new, and refused.)
        for _ in range(5):
            try:
                async with w1_db.transaction() as txn:
                    await txn.execute("INSERT INTO events VALUES (%s, 'w1', 'late')", (held_id,))
            except psycopg.OperationalError:
                continue
            except FencedError:
                break
            pytest.fail("the fenced run wrote the ID it held")
        else:
            pytest.fail("five transactions failed on connections from before the crash")
        # The held ID's work died with its connection: its block exits with the error.
        await held.__aexit__(RuntimeError, RuntimeError("connection lost"), None)

        # The writer writes again (it raised FencedError for good before).
        after = await w1.insert(insert, ("after",))
        assert after[0] > held_id > before[-1][0]
        assert w1_db.incarnation is not None
        assert w1_db.incarnation.epoch != first.epoch
        await w1.flush_position()
        stored, epoch, fenced_at = await _epoch_row(w1_db)
        assert epoch == w1_db.incarnation.epoch
        assert fenced_at is None
        assert stored >= stored_before  # never backwards through the fence
        assert stored >= after[0]
        # The reader passes the held ID and reads on to the new row.
        await pace.until(
            lambda: reader.get_persisted_upto_position() >= after[0],
            30,
            "the reader's linear position to pass w1's new row",
            every=0.05,
        )
        rows, _, _ = await reader.get_updates_since("w1", 0, after[0])
        assert [r.data["payload"] for r in rows] == ["before0", "before1", "before2", "after"]
    finally:
        await w1_db.close()
        await reader_db.close()
        await proxy.stop()


async def _stored(db: Database) -> int:
    return (await _epoch_row(db))[0]


# Per server port: the pid of its WAL writer, stopped (SIGSTOP) by the test.
_held_wal_writers: dict[int, int] = {}


@pytest.fixture
async def restartable_pg(
    restartable_pg: RestartablePostgres,
) -> AsyncIterator[RestartablePostgres]:
    """conftest's, whose WAL writer, when a test stopped it, runs again before the
    server is stopped (a stopped one would hold the shutdown up)."""
    yield restartable_pg
    pid = _held_wal_writers.pop(restartable_pg.port, None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _crash(server: RestartablePostgres) -> None:
    """kill -9 of the postmaster and of a stopped WAL writer (which would never notice
    its postmaster died, and hold the new one off), then start."""
    server.kill()
    pid = _held_wal_writers.pop(server.port, None)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.start()


async def _schema_with_slow_wal_writes(server: RestartablePostgres) -> None:
    """The events table, and a WAL writer that writes nothing out (stopped, SIGSTOP,
    until the crash): a crash then loses every position row stored since the last
    commit that waited for its WAL. Its 10 s cycle alone left a race: under load in
    CI it sometimes wrote out what the test's crash was meant to lose."""
    setup = await Database.connect(server.dsn, max_size=2)
    try:
        await setup.migrate()
        async with setup.connection() as conn:
            await conn.execute(
                "CREATE TABLE events (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
                " payload TEXT); CREATE INDEX ON events (instance_name, stream_id)"
            )
            await conn.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
            await conn.execute("SELECT pg_reload_conf()")
            row = await (
                await conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'"
                )
            ).fetchone()
            assert row is not None, "PostgreSQL shows no WAL writer"
            os.kill(row[0], signal.SIGSTOP)
            _held_wal_writers[server.port] = row[0]
    finally:
        await setup.close()


async def test_a_writers_position_never_goes_back_through_a_crash_and_a_restart(
    restartable_pg: RestartablePostgres,
) -> None:
    """R-ID-14 through a crash: position rows are stored with asynchronous commit, so a
    kill -9 of PostgreSQL loses the last of them. A writer whose last IDs have no rows
    (a rolled-back write) reported a position its rows cannot show; restarted after
    the crash, it started below it (before: at 4, having reported 6)."""
    server = restartable_pg
    await _schema_with_slow_wal_writes(server)
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=["w1"])
    insert = "INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING stream_id"
    w1_db = await Database.connect(server.dsn, max_size=4, incarnation=Incarnation.new("w1"))
    try:
        w1 = await MultiWriterIdGenerator.create(w1_db, spec, "w1", position_flush_interval=0.2)
        rows = [await w1.insert(insert) for _ in range(3)]  # 2, 3, 4: committed
        for _ in range(2):
            async with w1.get_next():  # 5, 6: taken, and the writes rolled back
                pass
        reported = w1.get_current_token_for_writer("w1")
        assert reported == 6 > rows[-1][0]
        await w1.flush_position()
        assert await _stored(w1_db) == reported
        await asyncio.to_thread(_crash, server)
        async with await psycopg.AsyncConnection.connect(server.dsn) as look:
            row = await (
                await look.execute(
                    "SELECT stream_id FROM stream_positions WHERE instance_name = 'w1'"
                )
            ).fetchone()
        assert row is not None
        assert row[0] < reported, "the crash lost the last position store (the premise)"
        # The writer lives through the crash; then its process restarts.
        await w1.close()
    finally:
        await w1_db.close()
    again_db = await Database.connect(server.dsn, max_size=4, incarnation=Incarnation.new("w1"))
    try:
        again = await MultiWriterIdGenerator.create(again_db, spec, "w1")
        assert again.get_current_token_for_writer("w1") >= reported
        assert await _stored(again_db) >= reported
        await again.close()
    finally:
        await again_db.close()


async def _writer_process(server: RestartablePostgres, **args: object) -> Process:
    """A writer in a process of its own (`crash_writer.py`) doing what `args` say."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(CRASH_WRITER),
        json.dumps({"dsn": server.dsn, **args}),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def _said(proc: Process, key: str) -> int:
    """The value of `key` in the next JSON line `proc` prints."""
    assert proc.stdout is not None
    line = await pace.wait(proc.stdout.readline(), 60, f"a writer process to say {key!r}")
    if not line:
        raise AssertionError(f"a writer process exited with {await proc.wait()}")
    return int(json.loads(line)[key])


@pytest.mark.parametrize("last_move", ["no_rows", "idle"])
async def test_a_writer_killed_with_postgresql_restarts_at_or_above_its_position(
    restartable_pg: RestartablePostgres, last_move: str
) -> None:
    """R-ID-14 when the writer process dies with PostgreSQL (kill -9 of both): the last
    position it reported was stored with asynchronous commit only, and no row shows it
    (IDs it rolled back, or the idle rule following another writer's). Before, the
    restarted writer started below it (at 2, having reported 3 or 4)."""
    server = restartable_pg
    await _schema_with_slow_wal_writes(server)
    writers = ["w1", "w2"]
    procs: list[Process] = []
    try:
        if last_move == "no_rows":
            procs.append(
                await _writer_process(server, name="w1", writers=writers, action="no_rows")
            )
            reported = await _said(procs[0], "reported")
        else:
            # w1 registers first: its registration, durable, must not carry w2's
            # position through the crash.
            procs.append(await _writer_process(server, name="w1", writers=writers, action="idle"))
            await _said(procs[0], "started")
            procs.append(
                await _writer_process(server, name="w2", writers=writers, action="no_rows")
            )
            other = await _said(procs[1], "reported")
            assert procs[0].stdin is not None
            procs[0].stdin.write(f"{other}\n".encode())
            await procs[0].stdin.drain()
            reported = await _said(procs[0], "reported")
        for proc in procs:
            proc.kill()
            await proc.wait()
        await asyncio.to_thread(_crash, server)
        async with await psycopg.AsyncConnection.connect(server.dsn, autocommit=True) as look:
            row = await (
                await look.execute(
                    "SELECT stream_id FROM stream_positions WHERE instance_name = 'w1'"
                )
            ).fetchone()
        assert row is not None
        if row[0] >= reported:
            # The WAL writer's own cycle (10 s here, its longest) fell between the last
            # store and the crash, and wrote it out: seen once in CI, under load.
            pytest.skip("the crash did not lose the last position store this time")
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=writers)
    again_db = await Database.connect(server.dsn, max_size=4, incarnation=Incarnation.new("w1"))
    try:
        again = await MultiWriterIdGenerator.create(again_db, spec, "w1")
        assert again.get_current_token_for_writer("w1") >= reported
        assert await _stored(again_db) >= reported
        insert = "INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING stream_id"
        assert (await again.insert(insert))[0] > reported
        await again.close()
    finally:
        await again_db.close()


async def _sequence_head(server: RestartablePostgres) -> int:
    async with await psycopg.AsyncConnection.connect(server.dsn, autocommit=True) as conn:
        row = await (await conn.execute("SELECT last_value FROM events_seq")).fetchone()
    assert row is not None
    return int(row[0])


class _Rollback(Exception):
    pass


async def _forty_rolled_back(db: Database, gen: MultiWriterIdGenerator) -> list[int]:
    """A transaction that takes 40 IDs (its nextval logs the sequence ahead at least
    once) and rolls back. Returns the IDs."""
    ids: list[int] = []

    async def rolled_back() -> None:
        async with db.transaction() as txn:
            ids.extend(await gen.get_next_mult_txn(txn, 40))
            raise _Rollback

    with pytest.raises(_Rollback):
        await rolled_back()
    return ids


async def test_a_rolled_back_transactions_ids_count_once_their_sequence_record_is_on_disk(
    restartable_pg: RestartablePostgres,
) -> None:
    """PostgreSQL logs a sequence 32 values ahead, and that record reaches the disk only
    when something flushes the WAL, which a rollback does not. Before, the IDs of a
    transaction that rolled back counted as finished at once: the writer reported the
    last as its position, and a crash right after brought the sequence back below it,
    to hand those IDs out again (a writer killed before it reconnects then restarts
    below what it reported, and commits rows readers may have passed)."""
    server = restartable_pg
    await _schema_with_slow_wal_writes(server)
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=["w1"])
    w1_db = await Database.connect(server.dsn, max_size=4, incarnation=Incarnation.new("w1"))
    try:
        # A long flush interval: no background statement flushes the WAL meanwhile.
        w1 = await MultiWriterIdGenerator.create(w1_db, spec, "w1", position_flush_interval=60)
        await w1.insert("INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING stream_id")
        ids = await _forty_rolled_back(w1_db, w1)
        await pace.until(
            lambda: w1.get_current_token_for_writer("w1") >= ids[-1],
            30,
            "w1's position to pass its rolled-back IDs",
            every=0.05,
        )
        reported = w1.get_current_token_for_writer("w1")
        await asyncio.to_thread(_crash, server)
        assert await _sequence_head(server) >= reported
        await w1.close()
    finally:
        await w1_db.close()


@pytest.mark.parametrize("style", ["get_next", "get_next_txn"])
async def test_an_id_without_a_row_counts_once_its_sequence_record_is_on_disk(
    restartable_pg: RestartablePostgres, style: str
) -> None:
    """SPEC: after a `get_next()` block exits, its ID is the writer's position, row or
    not; so after a `get_next_txn` transaction commits. When the sequence's log record
    under that ID was written by another transaction, still open, and the block or
    transaction wrote nothing, nothing had flushed it: before, a crash right after
    brought the sequence back below the position the writer had reported (and a writer
    killed with PostgreSQL restarted below it, R-ID-14)."""
    server = restartable_pg
    await _schema_with_slow_wal_writes(server)
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=["w1"])
    w1_db = await Database.connect(server.dsn, max_size=4, incarnation=Incarnation.new("w1"))
    other = await psycopg.AsyncConnection.connect(server.dsn)  # not autocommit
    try:
        # A long flush interval: no background statement flushes the WAL meanwhile.
        w1 = await MultiWriterIdGenerator.create(w1_db, spec, "w1", position_flush_interval=60)
        await w1.insert("INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING stream_id")
        await _log_the_sequence_ahead(other)

        def at(position: int) -> bool:
            return w1.get_current_token_for_writer("w1") == position

        for _ in range(3):
            if style == "get_next":
                async with w1.get_next() as new_id:
                    pass  # no row
                assert w1.get_current_token_for_writer("w1") == new_id
            else:
                async with w1_db.transaction() as txn:
                    new_id = await w1.get_next_txn(txn)  # and no row
                await pace.until(
                    functools.partial(at, new_id),
                    30,
                    "w1's position to reach its transaction's ID",
                    every=0.05,
                )
        await asyncio.to_thread(_crash, server)
        assert await _sequence_head(server) >= new_id
        await w1.close()
    finally:
        await w1_db.close()
        await other.close()


async def test_a_writer_fenced_after_a_crash_reports_no_position_above_the_sequence(
    restartable_pg: RestartablePostgres,
) -> None:
    """The long run of 2026-11-29 (w1, "own position went back 2217473 -> 2217456"): a
    write's IDs lay under a sequence record the crash lost, and the write failed with
    it. While PostgreSQL recovered, w1 could not reconnect and a reader fenced it; w1's
    next connection found the fence, and the failed write's IDs finished, for a fence
    flushes the WAL (but the record had died with the crash). w1 reported a position
    above the sequence head, and its next run started below it. A new connection now
    moves the sequence past the IDs its process took before it looks for a fence."""
    server = restartable_pg
    await _schema_with_slow_wal_writes(server)
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=["w1"])
    proxy, w1_db = await _w1_behind_a_proxy(server)
    other = await psycopg.AsyncConnection.connect(server.dsn)  # not autocommit
    reader_db: Database | None = None
    try:
        w1 = await MultiWriterIdGenerator.create(w1_db, spec, "w1", position_flush_interval=60)
        await w1.insert("INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING stream_id")
        await _log_the_sequence_ahead(other)
        first = w1_db.incarnation
        assert first is not None
        ids: list[int] = []

        async def write_dying_with_the_server() -> None:
            async with w1.get_next_mult(5) as taken:
                ids.extend(taken)
                await proxy.stop()  # w1 cannot reconnect until the test says so
                await asyncio.to_thread(_crash, server)
                raise _Rollback  # the write died with the server

        with pytest.raises(_Rollback):
            await write_dying_with_the_server()
        if await _sequence_head(server) >= ids[-1]:
            pytest.skip("the crash did not take the sequence back this time")
        reader_db = await Database.connect(server.dsn, max_size=4)
        await MultiWriterIdGenerator.create(
            reader_db, spec, "reader", position_flush_interval=0.1, fence_after=0.3
        )

        async def fenced() -> bool:
            return (await _epoch_row(reader_db))[2] is not None

        await pace.until(fenced, 30, "the reader to fence w1", every=0.05)
        await proxy.start()
        await pace.until(
            lambda: w1.get_current_token_for_writer("w1") >= ids[-1],
            30,
            "w1's failed write's IDs to finish",
            every=0.05,
        )
        # w1 found itself fenced: still so, or already gone on as a new incarnation once
        # its IDs finished (on a busy machine that can come first: CI saw it).
        renewed = w1_db.incarnation is not None and w1_db.incarnation.epoch != first.epoch
        assert w1_db.fenced or renewed
        assert await _sequence_head(server) >= w1.get_current_token_for_writer("w1")
        await w1.close()
    finally:
        await w1_db.close()
        await other.close()
        if reader_db is not None:
            await reader_db.close()
        await proxy.stop()


@pytest.mark.parametrize("write", ["get_next", "insert"])
async def test_a_writer_writes_above_its_position_after_a_crash_took_the_sequence_back(
    restartable_pg: RestartablePostgres, write: str
) -> None:
    """The sequence's log record ahead was written by another transaction, still open
    when the server crashes (so never flushed); the writer took IDs under it, wrote no
    row with them and reported the last as its position. After the crash the sequence
    is back below them. Before, the writer's next get_next was refused for good
    (SequenceBehindError: "stop all writers and restart them"), and its next insert
    committed a row below the position it had reported, which readers may have passed."""
    server = restartable_pg
    await _schema_with_slow_wal_writes(server)
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=["w1"])
    insert = "INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING stream_id"
    w1_db = await Database.connect(server.dsn, max_size=4, incarnation=Incarnation.new("w1"))
    other = await psycopg.AsyncConnection.connect(server.dsn)  # not autocommit
    try:
        # A long flush interval: no background statement meets the crash before the test's.
        w1 = await MultiWriterIdGenerator.create(w1_db, spec, "w1", position_flush_interval=60)
        await w1.insert(insert)
        # w1's five next IDs lie under the other transaction's record: w1 logs nothing,
        # flushes nothing. Its block is open at the crash.
        await _log_the_sequence_ahead(other)
        async with w1.get_next_mult(5) as ids:
            handed_out = ids[-1]
            await asyncio.to_thread(_crash, server)
            if await _sequence_head(server) >= handed_out:
                # The WAL writer woke and wrote the record out.
                pytest.skip("the crash did not take the sequence back this time")
        await pace.until(
            lambda: w1.get_current_token_for_writer("w1") >= handed_out,
            30,
            "w1's position to pass the IDs of its block",
            every=0.05,
        )

        new_id = await _write_after_the_crash(w1, write, insert)
        assert new_id > handed_out
        assert w1.get_current_token_for_writer("w1") >= new_id
        await w1.close()
    finally:
        await w1_db.close()
        await other.close()


@pytest.mark.parametrize("write", ["get_next", "insert"])
async def test_a_position_heard_after_reconnecting_is_caught_up_before_the_next_write(
    restartable_pg: RestartablePostgres, write: str
) -> None:
    """A crash took the sequence back below IDs w2 had reported; w1 reconnected (its
    new connections caught up only the heads it knew then) and only then heard w2's
    position, from a POSITION delayed past PostgreSQL's recovery. Before, w1's next
    get_next was refused for good (SequenceBehindError) and its next insert committed
    a row below a position readers may have passed (R-ID-14)."""
    server = restartable_pg
    await _schema_with_slow_wal_writes(server)
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=["w1", "w2"])
    insert = "INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING stream_id"
    w1_db = await Database.connect(server.dsn, max_size=4, incarnation=Incarnation.new("w1"))
    other = await psycopg.AsyncConnection.connect(server.dsn)  # not autocommit
    w2 = await psycopg.AsyncConnection.connect(server.dsn)
    try:
        w1 = await MultiWriterIdGenerator.create(w1_db, spec, "w1", position_flush_interval=60)
        await w1.insert(insert)
        # w2's five IDs lie under another transaction's record.
        # w2 took them in a transaction still open at the crash (rolled back by it,
        # finished: w2 reports the last), and died with PostgreSQL, so w2 brings the
        # sequence back up nowhere.
        await _log_the_sequence_ahead(other)
        for _ in range(5):
            row = await (await w2.execute("SELECT nextval('events_seq')")).fetchone()
        assert row is not None
        reported = int(row[0])
        await asyncio.to_thread(_crash, server)
        if await _sequence_head(server) >= reported:
            pytest.skip("the crash did not take the sequence back this time")
        # w1 finds its connections dead and makes new ones (it knows no head of w2's).
        assert await w1_db.retry_read("one", lambda: _one(w1_db)) == 1
        assert w1_db.connections_lost > 0
        assert await _sequence_head(server) < reported
        w1.vouched("w2", reported)  # the delayed POSITION

        new_id = await _write_after_the_crash(w1, write, insert)
        assert new_id > reported
        assert w1.get_current_token_for_writer("w1") >= new_id
        await w1.close()
    finally:
        await w1_db.close()
        await other.close()
        await w2.close()


async def _log_the_sequence_ahead(other: psycopg.AsyncConnection[Any]) -> None:
    """In `other`'s open transaction, take IDs until its own nextval has just logged
    the sequence ahead (log_cnt: values left before the next log record, rises when one
    is written): the next IDs anyone takes lie under that record, unflushed while
    `other` stays open, and take nothing to the disk themselves."""
    left = None
    for _ in range(100):
        await other.execute("SELECT nextval('events_seq')")
        row = await (await other.execute("SELECT log_cnt FROM events_seq")).fetchone()
        assert row is not None
        if left is not None and row[0] > left:
            return  # this nextval logged
        left = row[0]
    pytest.fail("100 nextval calls and the sequence's log record never moved")


async def _write_after_the_crash(gen: MultiWriterIdGenerator, write: str, insert: str) -> int:
    """One ID taken by `get_next` or `insert`, retried on a pooled connection from
    before the crash (it fails first)."""
    for _ in range(5):
        try:
            if write == "get_next":
                async with gen.get_next() as new_id:
                    return new_id
            return (await gen.insert(insert))[0]
        except psycopg.OperationalError:
            continue
    pytest.fail("five writes failed on connections from before the crash")


async def _one(db: Database) -> int:
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT 1")).fetchone()
        assert row is not None
        return int(row[0])


async def test_a_live_writer_stores_its_position_again_after_a_crash(
    restartable_pg: RestartablePostgres,
) -> None:
    """The crash took the writer's last position row back; the writer, alive, finds a
    connection dead and stores its position again, durably: a second crash keeps it."""
    server = restartable_pg
    await _schema_with_slow_wal_writes(server)
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=["w1"])
    w1_db = await Database.connect(server.dsn, max_size=4, incarnation=Incarnation.new("w1"))
    look = await Database.connect(server.dsn, max_size=2)
    try:
        w1 = await MultiWriterIdGenerator.create(w1_db, spec, "w1", position_flush_interval=0.2)
        await w1.insert("INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING stream_id")
        async with w1.get_next():  # no row
            pass
        reported = w1.get_current_token_for_writer("w1")
        await w1.flush_position()
        await asyncio.to_thread(_crash, server)
        lost = await look.retry_read("w1's row", lambda: _stored(look))
        assert lost < reported  # what the crash did (asynchronous commit)
        await pace.until(
            lambda: w1_db.connections_lost > 0,
            30,
            "w1 to find its connections lost in the crash",
            every=0.05,
        )

        async def stored_again() -> bool:
            return await look.retry_read("w1's row", lambda: _stored(look)) >= reported

        await pace.until(stored_again, 30, "w1 to store its position again", every=0.1)
        await asyncio.to_thread(_crash, server)
        assert await look.retry_read("w1's row", lambda: _stored(look)) >= reported
        await w1.close()
    finally:
        await w1_db.close()
        await look.close()


async def _refused_as_superseded(write: Callable[[], Awaitable[object]]) -> None:
    """`write()` fails with SupersededError; a statement on a connection that died with
    the cut may fail first (it is found dead only when used)."""
    for _ in range(5):
        try:
            await write()
        except SupersededError:
            return
        except psycopg.OperationalError:
            continue
        raise AssertionError("the superseded run wrote")
    raise AssertionError("the superseded run was not refused")


async def test_a_new_run_waits_for_the_previous_one_and_supersedes_it(
    restartable_pg: RestartablePostgres,
) -> None:
    """A starting writer takes its own committed rows as final (its previous run is
    over). Not while that run still has connections: it may still commit an ID below
    them (before: the new run started at 3 while 2 was uncommitted, and 2 committed
    after it). And once the new run registered, the old one, should it connect again,
    may write nothing (before: it wrote the ID it held, below the new run)."""
    server = restartable_pg
    await _schema_with_slow_wal_writes(server)
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=["w1"])
    insert = "INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING stream_id"
    # The old run reaches the server through a proxy: the test cuts it off, and decides
    # when it may connect again (after the new run registered).
    proxy, old_db = await _w1_behind_a_proxy(server)
    new_db = await Database.connect(
        server.dsn, max_size=4, incarnation=Incarnation.new("w1"), retry_reads_for=3.0
    )
    superseded: list[bool] = []
    old_db.on_superseded(lambda: superseded.append(old_db.superseded))
    try:
        old = await MultiWriterIdGenerator.create(old_db, spec, "w1")
        async with old_db.transaction() as txn:
            slow = await old.get_next_txn(txn)  # 2, uncommitted while 3 commits
            assert await old.insert(insert) == [3]
            with pytest.raises(InstanceRunningError, match=r"still has \d+ server process"):
                await MultiWriterIdGenerator.create(new_db, spec, "w1")
            await txn.execute("INSERT INTO events VALUES (%s, 'w1', 'slow')", (slow,))
        held = old.get_next()  # the old run holds 4 when it is cut off
        held_id = await held.__aenter__()
        await proxy.stop()
        new = await MultiWriterIdGenerator.create(new_db, spec, "w1")
        assert new.get_current_token_for_writer("w1") >= 3
        await proxy.start()

        async def late_write() -> None:
            async with old_db.transaction() as txn:
                await txn.execute("INSERT INTO events VALUES (%s, 'w1', 'late')", (held_id,))

        await _refused_as_superseded(late_write)
        await held.__aexit__(None, None, None)
        await _refused_as_superseded(lambda: old.insert(insert))
        assert superseded == [True]  # told once (an Instance stops replicating then)
        # The new run started below the head (the old run held 4): it took 5 and gave
        # it back, so its position is one the old run never reported (R-ID-14).
        assert await new.insert(insert) == [held_id + 2]
        rows, _, _ = await new.get_updates_since("w1", 0, held_id + 2)
        assert [r.stream_id for r in rows] == [2, 3, held_id + 2]
        await new.close()
        await old.close()
    finally:
        await old_db.close()
        await new_db.close()
        await proxy.stop()
