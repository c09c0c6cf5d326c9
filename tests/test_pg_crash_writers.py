"""Issue 18, finding 2: a PostgreSQL crash fenced every live writer for good. The crash
killed their connections, so readers rightly fenced them; but each writer then answered
"was fenced ... must not write again: restart it". A live writer now goes on as a new
incarnation by itself, and its position never goes backwards through the fence."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from psycopg.conninfo import make_conninfo

from pg_restarts import RestartablePostgres
from plait import Database, FencedError, MultiWriterIdGenerator, StreamSpec, TableSpec
from plait.check.proxy import CutProxy
from plait.ports import free_port
from plait.storage.incarnation import Incarnation

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def _until(what: str, condition: Callable[[], bool], within: float = 30.0) -> None:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            raise AssertionError(f"waited {within:g} s for {what}")
        await asyncio.sleep(0.05)


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
    proxy = CutProxy(free_port(), server.port)
    await proxy.start()
    through_proxy = make_conninfo(server.dsn, port=str(proxy.port))
    first = Incarnation.new("w1")
    w1_db = await Database.connect(through_proxy, max_size=4, incarnation=first)
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
        await asyncio.to_thread(server.crash)
        await _until("the reader to fence w1 after the crash", lambda: reader.fences >= 1)
        await proxy.start()  # ...until now
        # While the ID taken before the fence is held, this run may not write: it
        # could commit that ID below where the fence moved the readers.
        with pytest.raises(FencedError):
            async with w1_db.transaction() as txn:
                await txn.execute("INSERT INTO events VALUES (%s, 'w1', 'late')", (held_id,))
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
        await _until(
            "the reader's linear position to pass w1's new row",
            lambda: reader.get_persisted_upto_position() >= after[0],
        )
        rows, _, _ = await reader.get_updates_since("w1", 0, after[0])
        assert [r.data["payload"] for r in rows] == ["before0", "before1", "before2", "after"]
    finally:
        await w1_db.close()
        await reader_db.close()
        await proxy.stop()
