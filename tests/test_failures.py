"""Failures on the way: the database errors, the sequence goes backwards, a table has no
index. plait reports them and never leaves a position stuck or moved backwards."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import pytest

import pace
from plait import Database, SequenceBehindError
from stream_helpers import create_generator, create_table, stored_positions, write_in_txn


async def test_allocation_errors_reach_every_waiter_and_leave_nothing_in_flight(
    db: Database,
) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    async with gen.get_next_mult(3):
        pass
    async with db.connection() as conn:
        await conn.execute("ALTER SEQUENCE events_seq RENAME TO events_seq_away")

    async def one() -> int:
        async with gen.get_next() as stream_id:
            return stream_id

    # The first caller fetches directly, the others queue and share the next round trip.
    results = await asyncio.gather(*(one() for _ in range(10)), return_exceptions=True)
    assert all(isinstance(r, psycopg.errors.UndefinedTable) for r in results), results
    assert gen._tracker.fetches_in_flight() == 0
    assert gen._tracker.unfinished() == []
    async with db.connection() as conn:
        await conn.execute("ALTER SEQUENCE events_seq_away RENAME TO events_seq")
    assert await asyncio.gather(*(one() for _ in range(3))) == [5, 6, 7]
    assert gen.get_current_token() == 7


async def test_a_waiter_cancelled_while_queued_gives_its_ids_back(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    gate = asyncio.Event()
    real_fetch = gen._allocator._fetch

    async def slow_fetch(n: int) -> list[int]:
        await gate.wait()
        return await real_fetch(n)

    gen._allocator._fetch = slow_fetch
    first = asyncio.create_task(gen._allocator.allocate(1))  # fetches directly, held
    await asyncio.sleep(0.05)
    queued = [asyncio.create_task(gen._allocator.allocate(1)) for _ in range(3)]
    await asyncio.sleep(0.05)
    queued[1].cancel()  # gone before its batch comes back
    gate.set()
    assert await first == [2]
    got = await asyncio.gather(*queued, return_exceptions=True)
    assert got[0] == [3]
    assert isinstance(got[1], asyncio.CancelledError)
    assert got[2] == [5]
    gen._finisher.finish([2])
    gen._finisher.finish([3])
    gen._finisher.finish([5])
    # ID 4 went to the cancelled waiter: it was given back (finished once the WAL was
    # flushed, R-ID-14), so nothing is stuck at 3.
    await pace.until(lambda: gen.get_current_token() == 5, 10, "the given-back ID to finish")
    assert gen._tracker.unfinished() == []


async def test_sequence_moved_backwards_refuses_to_hand_out_ids(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    async with gen.get_next_mult(5):
        pass
    assert gen.get_current_token() == 6
    async with db.connection() as conn:
        await conn.execute("SELECT setval('events_seq', 2)")  # someone reset it
    with pytest.raises(SequenceBehindError, match="reset or moved backwards"):
        async with gen.get_next():
            pass
    with pytest.raises(SequenceBehindError):
        await gen.insert("INSERT INTO events VALUES ({id}, 'w') RETURNING stream_id")
    assert gen.get_current_token() == 6  # nothing moved backwards
    assert gen._tracker.fetches_in_flight() == 0
    assert gen._tracker.unfinished() == []


async def test_tables_without_the_writer_index_still_work(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    async with db.connection() as conn:
        await conn.execute(
            "CREATE TABLE events (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL)"
        )
        await conn.execute(
            "INSERT INTO events SELECT g, CASE WHEN g % 2 = 0 THEN 'a' ELSE 'b' END"
            " FROM generate_series(1, 20) g"
        )
        await conn.execute("CREATE SEQUENCE events_seq")
        await conn.execute("SELECT setval('events_seq', 20)")
        await conn.execute(
            "INSERT INTO stream_positions VALUES ('events', 'a', 10), ('events', 'b', 9)"
        )
    with caplog.at_level(logging.WARNING, logger="plait"):
        reader = await create_generator(db, ["a", "b"], "reader")
    assert any(
        "has no index on (instance_name, stream_id)" in r.getMessage() for r in caplog.records
    )
    assert reader.get_current_token() == 20  # rows 10..20 found above the floor of 9
    rows, upto, limited = await reader.get_updates_since("a", 10, 20, limit=3)
    # A full page may have cut its last ID short, so it ends just below it.
    assert [r.stream_id for r in rows] == [12, 14]
    assert (upto, limited) == (15, True)
    rows, upto, limited = await reader.get_updates_since("a", upto, 20, limit=10)
    assert [r.stream_id for r in rows] == [16, 18, 20]
    assert (upto, limited) == (20, False)


async def test_reads_across_writers_warn_once_when_no_index_leads_with_the_id(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    await create_table(db)  # only the (instance_name, stream_id) index
    gen = await create_generator(db, ["w"], "w")
    await gen.insert("INSERT INTO events VALUES ({id}, 'w') RETURNING stream_id")

    def scan_warnings() -> int:
        return sum("no index led by stream_id" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="plait"):
        await gen.get_updates_since("w", 0, 5)  # per writer: the index serves it
        assert scan_warnings() == 0
        for _ in range(2):
            rows, _, _ = await gen.get_updates_since(None, 0, 5)
            assert [r.stream_id for r in rows] == [2]
        assert scan_warnings() == 1
    async with db.connection() as conn:
        await conn.execute("CREATE INDEX ON events (stream_id)")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="plait"):
        other = await create_generator(db, ["w"], "reader")
        await other.get_updates_since(None, 0, 5)
    assert scan_warnings() == 0


async def test_position_writer_retries_until_the_database_answers(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w", position_flush_interval=0.05)
    async with db.connection() as conn:
        await conn.execute("ALTER TABLE stream_positions RENAME TO stream_positions_away")
    with caplog.at_level(logging.WARNING, logger="plait"):
        async with gen.get_next_mult(4):
            pass
        for _ in range(500):  # its next tries, 0.05 s apart on a quiet machine (10 s at most)
            if any("could not update stream_positions" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.02)
    assert any("could not update stream_positions" in r.getMessage() for r in caplog.records)
    async with db.connection() as conn:
        await conn.execute("ALTER TABLE stream_positions_away RENAME TO stream_positions")
    for _ in range(100):
        if (await stored_positions(db)).get("w") == 5:
            break
        await asyncio.sleep(0.05)
    assert await stored_positions(db) == {"w": 5}


async def test_connection_killed_before_commit(db: Database) -> None:
    """The COMMIT fails with the connection: plait waits until the server has finished
    the transaction (its xid is known), completes the ID, and replaces the connection."""
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")

    async def write_then_lose_the_connection() -> None:
        async with write_in_txn(db, gen) as txn:
            row = await (await txn.execute("SELECT pg_backend_pid()")).fetchone()
            assert row is not None
            async with db.connection() as other:
                await other.execute("SELECT pg_terminate_backend(%s)", (row[0],))

    with pytest.raises(psycopg.OperationalError):
        await write_then_lose_the_connection()
    # The ID completed (once the WAL was flushed: R-ID-14)...
    await pace.until(lambda: gen.get_current_token() == 2, 10, "the ID to complete")
    assert await gen.get_updates_since("w", 0, 2) == ([], 2, False)  # ...with no row
    assert await gen.insert("INSERT INTO events VALUES ({id}, 'w') RETURNING stream_id") == [3]
    assert gen.get_current_token() == 3
