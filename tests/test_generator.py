"""MultiWriterIdGenerator on real PostgreSQL: allocation, completion, position rows."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import psycopg
import pytest

import pace
from plait import (
    Database,
    MultiWriterIdGenerator,
    NotAWriterError,
    PositionAboveHeadError,
    StreamSpec,
    StreamToken,
    TableSpec,
)
from stream_helpers import (
    create_generator,
    create_table,
    insert_rows,
    stored_positions,
    write_in_txn,
)


async def test_non_writer_cannot_allocate(db: Database) -> None:
    await create_table(db)
    reader = await create_generator(db, ["first", "second"], "worker")
    with pytest.raises(NotAWriterError, match="'worker' is not a writer of stream 'events'"):
        reader.get_next()
    with pytest.raises(NotAWriterError):
        reader.get_next_mult(2)
    async with db.transaction() as txn:
        with pytest.raises(NotAWriterError):
            await reader.get_next_txn(txn)
    assert reader.get_positions() == {"first": 1, "second": 1}


async def test_get_next_txn_completes_after_commit_and_rollback(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    async with db.transaction() as txn:
        stream_id = await gen.get_next_txn(txn)
        assert stream_id == 2
        await txn.execute(
            "INSERT INTO events (stream_id, instance_name) VALUES (%s, 'master')", (stream_id,)
        )
        assert gen.get_current_token() == 1  # not before commit
    assert gen.get_current_token() == 2

    class Boom(Exception):
        pass

    async def write_then_fail() -> None:
        async with db.transaction() as txn:
            ids = await gen.get_next_mult_txn(txn, 3)
            assert ids == [3, 4, 5]
            raise Boom

    with pytest.raises(Boom):
        await write_then_fail()
    # Rolled-back IDs complete too, once the WAL is flushed (a round trip later): the
    # sequence's log record must survive a crash first (R-ID-14).
    await pace.until(lambda: gen.get_current_token() == 5, 10, "the rolled-back IDs to complete")
    rows, upto, limited = await gen.get_updates_since("master", 0, 5)
    assert [r.stream_id for r in rows] == [2]
    assert (upto, limited) == (5, False)


async def test_failing_write_in_get_next_still_completes(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    with pytest.raises(RuntimeError):
        async with gen.get_next():
            raise RuntimeError("write failed")
    await pace.until(lambda: gen.get_current_token() == 2, 10, "the failed write's ID to complete")
    async with gen.get_next() as stream_id:
        assert stream_id == 3


async def test_a_get_next_blocks_commit_through_the_database_says_its_ids_are_on_disk(
    db: Database,
) -> None:
    """A block's IDs count once the WAL is on disk past their allocation (R-ID-14). A
    row committed through the writer's `Database` inside the block reads how far the
    WAL is on disk with its COMMIT, so the exit needs no statement of its own; outside
    a block, commits do not read it."""
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    async with gen.get_next() as stream_id:
        allocated = gen._store.allocated_lsn
        assert db.wal.flushed < allocated
        async with db.transaction() as txn:
            await txn.execute(
                "INSERT INTO events (stream_id, instance_name) VALUES (%s, 'master')",
                (stream_id,),
            )
        assert db.wal.flushed >= allocated  # the exit has nothing left to ask
    assert gen.get_current_token() == stream_id
    flushed = db.wal.flushed
    async with db.transaction() as txn:
        await txn.execute("INSERT INTO events (stream_id, instance_name) VALUES (99, 'x')")
    assert db.wal.flushed == flushed


async def test_concurrent_get_next_share_round_trips(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    seen: list[int] = []

    async def one() -> None:
        async with gen.get_next() as stream_id:
            seen.append(stream_id)
            await asyncio.sleep(0)

    await asyncio.gather(*(one() for _ in range(100)))
    assert sorted(seen) == list(range(2, 102))
    assert gen._allocator.round_trips < 20  # 100 calls, a handful of round trips
    assert gen.get_current_token() == 101


async def test_cancelled_allocation_does_not_stall_the_position(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")

    async def slow() -> None:
        async with gen.get_next():
            await asyncio.sleep(30)

    tasks = [asyncio.create_task(slow()) for _ in range(5)]
    await asyncio.sleep(0.2)
    assert gen.get_current_token() == 1
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # Finished once the WAL was flushed (R-ID-14), a round trip later.
    await pace.until(lambda: gen.get_current_token() == 6, 10, "the cancelled IDs to complete")
    assert gen._tracker.unfinished() == []


async def test_position_upserts_are_coalesced(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    writer = gen._position_writer
    assert writer is not None

    async def one() -> None:
        async with gen.get_next() as stream_id, db.transaction() as txn:
            await txn.execute(
                "INSERT INTO events (stream_id, instance_name) VALUES (%s, 'master')",
                (stream_id,),
            )

    await asyncio.gather(*(one() for _ in range(200)))
    await gen.flush_position()
    assert await stored_positions(db) == {"master": 201}
    assert writer.upserts < 50, writer.upserts  # 200 writes, far fewer upserts


async def test_positions_flushed_in_background_after_writes(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    async with gen.get_next_mult(10):
        pass
    for _ in range(100):
        if (await stored_positions(db)).get("master") == 11:
            break
        await asyncio.sleep(0.02)
    assert await stored_positions(db) == {"master": 11}


async def test_idle_writer_flushes_advanced_position(db: Database) -> None:
    """An idle writer learns others' positions from the database and stores its own,
    so a database-only reader's linear position reaches the end."""
    await create_table(db)
    writers = ["busy", "idle"]
    busy = await create_generator(db, writers, "busy", position_flush_interval=0.1)
    idle = await create_generator(db, writers, "idle", position_flush_interval=0.1)
    reader = await create_generator(db, writers, "reader")
    async with busy.get_next_mult(20) as ids:
        assert ids[-1] == 21
    deadline = asyncio.get_running_loop().time() + 3
    while asyncio.get_running_loop().time() < deadline:
        await reader.refresh_positions()
        if reader.get_current_token() == 21:
            break
        await asyncio.sleep(0.05)
    assert reader.get_current_token() == 21
    assert (await stored_positions(db))["idle"] == 21
    assert idle.get_current_token() == 21


async def test_a_replicated_idle_writer_follows_stored_positions_while_it_hears_nothing(
    db: Database,
) -> None:
    """A writer fed by replication (`follow_database=False`) that hears nothing (Redis
    down, or out of its reach) still moves its own idle position to the others' stored
    ones, so database-only readers (Spark) do not stall on it (R-ID-8). It moves nothing
    else: the others' positions and persisted-up-to wait for replication."""
    await create_table(db)
    writers = ["busy", "idle"]
    busy = await create_generator(db, writers, "busy", position_flush_interval=0.1)
    idle = await create_generator(
        db, writers, "idle", position_flush_interval=0.1, follow_database=False
    )
    async with busy.get_next_mult(20) as ids:
        assert ids[-1] == 21
    await busy.flush_position()
    deadline = asyncio.get_running_loop().time() + 3
    while asyncio.get_running_loop().time() < deadline:
        if (await stored_positions(db))["idle"] == 21:
            break
        await asyncio.sleep(0.05)
    assert (await stored_positions(db))["idle"] == 21
    assert idle.get_current_token_for_writer("idle") == 21
    assert idle.get_positions()["busy"] == 1  # never heard of
    assert idle.get_current_token() == 1
    # Once replication feeds it, it reads nothing more (one tick may be under way).
    reads = 0
    load = idle.store.load_positions

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal reads
        reads += 1
        return await load(*args, **kwargs)

    async with busy.get_next_mult(50) as written:
        pass
    idle.store.load_positions = counted  # type: ignore[method-assign]
    # About ten flush intervals, replication delivering busy's positions five times an
    # interval: no database round trip between two deliveries, so however slow the
    # machine, no refresh tick passes without news since the one before (on a loaded
    # machine a write between deliveries spanned two ticks, and the second one read).
    for later in written:
        idle.advance("busy", later)  # what a POSITION from busy does
        await asyncio.sleep(0.02)
    assert reads <= 1
    assert idle.get_current_token_for_writer("idle") == written[-1]


async def test_any_writer_mode_keeps_no_position_rows(db: Database) -> None:
    await create_table(db)
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=[])
    one = await MultiWriterIdGenerator.create(db, spec, "one")
    two = await MultiWriterIdGenerator.create(db, spec, "two")
    async with one.get_next() as a, two.get_next() as b:
        assert {a, b} == {2, 3}
        async with db.transaction() as txn:
            for sid, name in ((a, "one"), (b, "two")):
                await txn.execute(
                    "INSERT INTO events (stream_id, instance_name) VALUES (%s, %s)", (sid, name)
                )
    await one.close()
    await two.close()
    assert await stored_positions(db) == {}
    again = await MultiWriterIdGenerator.create(db, spec, "three")
    assert again.get_current_token() == 3  # the max over the table


async def test_restart_carries_on_without_reusing_ids(db: Database) -> None:
    await create_table(db)
    writers = ["first", "second"]
    first = await create_generator(db, writers, "first")
    second = await create_generator(db, writers, "second")
    async with first.get_next_mult(3), second.get_next_mult(2):
        pass
    await first.close()
    await second.close()
    assert await stored_positions(db) == {"first": 4, "second": 6}
    first = await create_generator(db, writers, "first")
    assert first.get_current_token_for_writer("first") == 6  # everything it knows completed
    async with first.get_next() as stream_id:
        assert stream_id == 7
    # "second" is at 6 and 7 is first's own completed ID: nothing below 7 is pending.
    assert first.get_current_token() == 7
    assert first.get_current_token_for_writer("first") == 7


async def test_token_round_trip_through_instance_map(db: Database) -> None:
    await create_table(db)
    writers = ["first", "second"]
    first = await create_generator(db, writers, "first")
    second = await create_generator(db, writers, "second")
    held = second.get_next()
    assert await held.__aenter__() == 2  # in flight on "second"
    async with first.get_next_mult(3) as ids:
        assert ids == [3, 4, 5]
    token = StreamToken.from_generator(first)
    assert token == StreamToken(1, {"first": 5})
    await held.__aexit__(None, None, None)
    text = await token.to_string(db)
    assert text.startswith("m1~")
    assert await StreamToken.parse(db, text) == token
    assert await StreamToken.parse(db, "s7") == StreamToken(7)
    instance_ids = await db.get_instance_ids(["first", "second", "first"])
    assert set(instance_ids) == {"first", "second"}
    assert instance_ids["first"] != instance_ids["second"]
    # Known names are never inserted again: the serial is not burnt.
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT max(instance_id) FROM instance_map")).fetchone()
    assert row == (2,)


async def test_tokens_of_backwards_streams_hold_magnitudes(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master", backwards=True)
    async with gen.get_next_mult(2):
        pass
    assert gen.get_current_token() == -3
    assert StreamToken.from_generator(gen) == StreamToken(3)


async def test_max_allocated_token(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    async with gen.get_next_mult(4):
        assert await gen.get_max_allocated_token() == 5
    assert await gen.get_max_allocated_token() == 5


async def test_stream_spec_recorded_for_database_readers(db: Database) -> None:
    await create_table(db)
    await insert_rows(db, "a", 1)
    gen = await create_generator(db, ["a", "b"], "a")
    async with db.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT sequence_name, backwards, writers, tables FROM plait_streams"
                " WHERE stream_name = 'events'"
            )
        ).fetchone()
    assert row == (
        "events_seq",
        False,
        ["a", "b"],
        [{"name": "events", "id_column": "stream_id", "instance_column": "instance_name"}],
    )
    assert gen.spec == StreamSpec.from_json(gen.spec.to_json())


async def test_close_via_database(dsn: str) -> None:
    db = await Database.connect(dsn)
    await db.migrate()
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    async with gen.get_next_mult(2):
        pass
    await db.close()  # stops the generator's background task and flushes its position
    db = await Database.connect(dsn)
    try:
        assert await stored_positions(db) == {"master": 3}
    finally:
        await db.close()


async def test_cancelled_during_commit_runs_the_right_callbacks(db: Database) -> None:
    """A task cancelled while COMMIT is in flight still learns how the transaction ended."""
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    outcome: list[str] = []
    committed = asyncio.Event()

    async def write() -> None:
        async with write_in_txn(db, gen, outcome):
            # The test task runs again only once this one awaits, which is at COMMIT.
            committed.set()

    task = asyncio.create_task(write())
    await committed.wait()
    task.cancel()  # lands while the block exits, i.e. during COMMIT
    with pytest.raises(asyncio.CancelledError):
        await task
    rows, _, _ = await gen.get_updates_since("master", 0, 10)
    assert outcome == (["committed"] if rows else ["rolled back"])
    # The ID completed either way (rolled back: once the WAL was flushed, R-ID-14).
    await pace.until(lambda: gen.get_current_token() == 2, 10, "the ID to complete")
    assert gen._tracker.unfinished() == []


async def test_psycopg_rollback_is_honoured(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    async with write_in_txn(db, gen):
        raise psycopg.Rollback
    assert await gen.get_updates_since("master", 0, 10) == ([], 10, False)
    await pace.until(lambda: gen.get_current_token() == 2, 10, "the rolled-back ID to complete")


async def test_commit_after_a_caught_error_is_not_reported_as_committed(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    outcome: list[str] = []

    async def write() -> None:
        async with write_in_txn(db, gen, outcome) as txn:
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                await txn.execute("SELECT 1/0")

    with pytest.raises(psycopg.errors.InFailedSqlTransaction, match="nothing was committed"):
        await write()
    assert outcome == ["rolled back"]
    assert await gen.get_updates_since("master", 0, 10) == ([], 10, False)
    await pace.until(lambda: gen.get_current_token() == 2, 10, "the rolled-back ID to complete")


async def test_transaction_round_trips(db: Database) -> None:
    """BEGIN travels with the first statement; an empty transaction costs nothing."""
    await create_table(db)
    async with db.transaction() as txn:
        pass
    async with db.transaction() as txn:
        cur = await txn.execute("SELECT txid_current_if_assigned() IS NULL, 42")
        assert await cur.fetchone() == (True, 42)
        conn = await txn.connection()
        assert conn.info.transaction_status == conn.info.transaction_status.INTRANS
        await txn.executemany(
            "INSERT INTO events (stream_id, instance_name) VALUES (%s, %s)",
            [(i, "w") for i in range(2, 12)],
        )
    async with db.connection() as conn:
        row = await (await conn.execute("SELECT count(*) FROM events")).fetchone()
    assert row == (10,)


@pytest.mark.parametrize(
    ("query", "params"),
    [
        ("INSERT INTO events (stream_id, instance_name) VALUES (1, NULL)", None),
        ("INSERT INTO events (stream_id, instance_name) VALUES (%s, %s)", (1, None)),
    ],
    ids=["simple-query", "pipeline"],
)
async def test_a_failing_first_statement_rolls_back(
    db: Database, query: str, params: tuple[object, ...] | None
) -> None:
    """The first statement carries BEGIN (in one simple query without parameters, in a
    pipeline with them); when it fails, the transaction still ends and says so."""
    await create_table(db)
    outcome: list[str] = []

    async def write() -> None:
        async with db.transaction() as txn:
            txn.call_after(lambda: outcome.append("committed"))
            txn.call_on_exception(lambda: outcome.append("rolled back"))
            await txn.execute(query, params)

    with pytest.raises(psycopg.errors.NotNullViolation):
        await write()
    assert outcome == ["rolled back"]
    async with db.connection() as conn:
        assert conn.info.transaction_status == conn.info.transaction_status.IDLE


async def test_get_next_txn_as_the_first_statement(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    async with db.transaction() as txn:
        first = await gen.get_next_txn(txn)  # its statement is the one carrying BEGIN
        await txn.execute(
            "INSERT INTO events (stream_id, instance_name) VALUES (%s, 'master')", (first,)
        )
        assert txn.xid is not None
    rows, upto, limited = await gen.get_updates_since("master", 0, first)
    assert [r.stream_id for r in rows] == [first]
    assert (upto, limited) == (first, False)


async def test_positions_of_unconfigured_writers_are_ignored(db: Database) -> None:
    await create_table(db)
    reader = await create_generator(db, ["a", "b"], "reader")
    reader.advance("a", 5)
    reader.advance("b", 5)
    reader.advance("removed", 2)  # a late message from a writer no longer configured
    assert reader.get_positions() == {"a": 5, "b": 5}
    reader.advance("a", 9)
    reader.advance("b", 9)
    assert reader.get_current_token() == 9


async def test_start_up_settings_stay_inside_its_own_transaction(db: Database) -> None:
    """Start-up turns JIT off for its reads only; the pooled connection keeps the
    server's setting for whatever runs on it next."""
    await create_table(db)
    async with db.connection() as conn:
        before = await (await conn.execute("SHOW jit")).fetchone()
    await create_generator(db, ["master"], "master")
    async with db.connection() as conn:
        assert conn.info.transaction_status == conn.info.transaction_status.IDLE
        assert await (await conn.execute("SHOW jit")).fetchone() == before
    async with db.connection() as conn:
        row = await (
            await conn.execute("SELECT stream_name FROM plait_streams WHERE stream_name = 'events'")
        ).fetchone()
    assert row == ("events",)  # the spec recorded in the same transaction was committed


async def test_writers_starting_together_create_the_sequence_once(dsn: str, db: Database) -> None:
    """Each writer has its own connections (as separate processes do); the first creates
    the sequence and the others, who all saw it missing a moment before, use it."""
    await create_table(db)
    writers = [f"w{i}" for i in range(6)]
    databases = [await Database.connect(dsn, min_size=1, max_size=2) for _ in writers]
    try:
        gens = await asyncio.gather(
            *(create_generator(d, writers, w) for d, w in zip(databases, writers, strict=True))
        )
        ids: list[int] = []
        for gen in gens:
            async with gen.get_next() as stream_id:
                ids.append(stream_id)
        assert ids == list(range(2, 8))  # created once, and ID 1 taken once, at creation
        for gen in gens:
            await gen.close()
    finally:
        for d in databases:
            await d.close()


async def test_oldest_unfinished_age_counts_from_when_the_held_id_was_taken(
    db: Database,
) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    reader = await create_generator(db, ["master"], "worker")
    assert gen.oldest_unfinished_age() is None  # nothing pending
    assert reader.oldest_unfinished_age() is None  # not a writer
    async with db.transaction() as txn:
        await gen.get_next_txn(txn)
        await asyncio.sleep(0.3)
        async with gen.get_next():  # a later write, finished: the held one still counts
            pass
        held = gen.oldest_unfinished_age()
        assert held is not None
        assert 0.3 <= held < 5
    assert gen.oldest_unfinished_age() is None
    async with gen.get_next():
        age = gen.oldest_unfinished_age()
        assert age is not None
        assert age < 0.3
    assert gen.oldest_unfinished_age() is None


@pytest.mark.parametrize("backwards", [False, True])
async def test_a_position_above_the_sequence_head_is_never_stored(
    db: Database, backwards: bool
) -> None:
    """Issue 18, finding 1: a writer stored 10^9 while the sequence stood at 407, and
    every later write and restart failed. The statement itself refuses it (R-ID-14)."""
    await create_table(db)
    gen = await create_generator(db, ["first", "second"], "first", backwards=backwards)
    sign = -1 if backwards else 1
    async with gen.get_next():
        pass
    await gen.flush_position()
    before = await stored_positions(db)
    with pytest.raises(PositionAboveHeadError, match="names no ID"):
        await gen.store.upsert_position("second", 1_000_000_000, durable=False)
    with pytest.raises(PositionAboveHeadError):
        await gen.store.upsert_position("first", 3, durable=True)  # the head is 2
    assert await stored_positions(db) == before
    await gen.store.upsert_position("second", 2, durable=False)  # at the head: stored
    assert (await stored_positions(db))["second"] == sign * 2
    # A peer's forged claim reaches the tracker only through `advance` (trusted
    # input); the replication handler checks claims first (`is_allocated`).
    assert not await gen.is_allocated(sign * 3)
    assert await gen.is_allocated(sign * 2)
    gen.advance("second", sign * 1_000_000_000)  # as a buggy caller would
    await gen.flush_position()  # stores what it can (the next test)
    assert max(abs(p) for p in (await stored_positions(db)).values()) == 2
    await gen.close()


@pytest.mark.parametrize("backwards", [False, True])
async def test_a_writer_takes_no_position_above_the_head_from_advance(
    db: Database, dsn: str, backwards: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: a wrong `advance` (trusted input) moved an idle writer's own position
    to an ID the sequence had not handed out; its store was refused every interval, its
    row stayed where it was for good, and its next write failed ("the sequence
    returned 3, but IDs up to 1000000000 were already seen"). A writer now checks such
    a position against the sequence first: it refuses it, says so once, and writes on;
    a position the sequence has handed out is taken once that is confirmed."""
    await create_table(db)
    sign = -1 if backwards else 1
    gen = await create_generator(
        db, ["first", "second"], "first", backwards=backwards, position_flush_interval=0.05
    )
    insert = "INSERT INTO events VALUES ({id}, 'first') RETURNING stream_id"
    await gen.insert(insert)
    wrong = sign * 1_000_000_000
    with caplog.at_level(logging.WARNING, logger="plait"):
        for _ in range(3):
            gen.advance("second", wrong)  # as a buggy caller would
            await asyncio.sleep(0.1)
        assert gen.get_positions()["second"] != wrong
        last = (await gen.insert(insert))[0]
        for _ in range(2):
            last = (await gen.insert(insert))[0]
        assert gen.get_current_token_for_writer("first") == last
        await gen.flush_position()
        assert (await stored_positions(db))["first"] == last
    said = [r for r in caplog.records if str(wrong) in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert "advance" in said[0].getMessage()  # what went wrong

    # A true position from elsewhere (another process's sequence head is not known
    # here yet) is taken once the sequence confirms it.
    other_db = await Database.connect(dsn, max_size=2)
    try:
        second = await create_generator(
            other_db, ["first", "second"], "second", backwards=backwards
        )
        taken = (await second.insert(insert.replace("'first'", "'second'")))[0]
        assert not gen.is_known_allocated(taken)
        gen.advance("second", taken)
        deadline = asyncio.get_running_loop().time() + 10
        while gen.get_positions()["second"] != taken:
            assert asyncio.get_running_loop().time() < deadline, "the position was not taken"
            await asyncio.sleep(0.02)
        assert gen.get_current_token_for_writer("first") == taken  # idle: the idle rule
        await second.close()
    finally:
        await other_db.close()
    await gen.close()


@pytest.mark.parametrize("backwards", [False, True])
async def test_a_database_only_reader_passes_committed_rows_below_a_long_transaction(
    db: Database, backwards: bool
) -> None:
    """Issue 18 (the long run's dblinear stall of 8.9 s): a writer whose ID waits in a
    long transaction stands at its last finished ID, below IDs the other writers have
    committed meanwhile. A reader fed by replication skips over those rows; a reader of
    the database alone stood with the slow writer until its transaction ended. It now
    skips over committed rows that leave no gap (R-ID-4), and never over the pending
    ID (no row) or a rolled-back one."""
    await create_table(db)
    sign = -1 if backwards else 1
    writers = ["slow", "fast"]
    slow = await create_generator(db, writers, "slow", backwards=backwards)
    fast = await create_generator(db, writers, "fast", backwards=backwards)
    reader = await create_generator(
        db, writers, "reader", backwards=backwards, position_flush_interval=0.05
    )
    insert = "INSERT INTO events (stream_id, instance_name) SELECT unnest(%s::bigint[]), %s"

    async def write(ids: list[int], writer: str) -> None:
        async with db.connection() as conn:
            await conn.execute(insert, (ids, writer))

    async with slow.get_next() as first:  # 2: slow's last finished ID
        await write([first], "slow")
    released = asyncio.Event()

    taken = asyncio.Event()

    async def long_transaction() -> None:
        async with db.transaction() as txn:
            pending = await slow.get_next_txn(txn)  # 6: waits
            assert pending == sign * 6
            await txn.execute(insert, ([pending], "slow"))
            taken.set()
            await released.wait()

    async with db.transaction() as txn:
        below = await fast.get_next_mult_txn(txn, 3)  # 3, 4, 5: taken before slow's
        assert below == [sign * i for i in (3, 4, 5)]
        waiting = asyncio.create_task(long_transaction())
        await taken.wait()
        await txn.execute(insert, (below, "fast"))
    try:
        await fast.flush_position()
        await slow.flush_position()
        assert (await stored_positions(db))["slow"] == sign * 2
        await pace.until(
            lambda: reader.get_current_token() == sign * 5,
            10,
            "the database-only reader to pass fast's rows 3 to 5",
        )
        # Rows above the pending ID do not let it pass it, nor does a rolled-back ID.
        with contextlib.suppress(RuntimeError):
            async with db.transaction() as txn:
                await fast.get_next_txn(txn)  # 7
                raise RuntimeError("rolled back")
        async with fast.get_next_mult(2) as above:  # 8, 9
            await write(above, "fast")
        await pace.until(
            lambda: fast.get_current_token_for_writer("fast") == sign * 9, 10, "fast at 9"
        )
        await fast.flush_position()
        for _ in range(5):
            await reader.refresh_positions()
        assert reader.get_current_token() == sign * 5
    finally:
        released.set()
        await waiting
    await slow.refresh_positions()  # idle: at fast's 9 (R-ID-5), over the rolled-back 7
    await slow.flush_position()
    await pace.until(
        lambda: reader.get_current_token() == sign * 9,
        10,
        "the reader to pass 6 and 7 once slow committed 6",
    )
    for gen in (slow, fast, reader):
        await gen.close()


async def test_a_database_only_reader_passing_rows_outlasts_a_lost_connection(
    db: Database, dsn: str
) -> None:
    """The long run's dblinear reader died of `OperationalError` ("server closed the
    connection unexpectedly"): PostgreSQL crashed between its read of the positions
    and its read of the committed IDs above them, and only the first was retried. Both
    reads of a refresh outlast a lost connection."""
    await create_table(db)
    writers = ["slow", "fast"]
    slow = await create_generator(db, writers, "slow")
    fast = await create_generator(db, writers, "fast")
    reader_db = await Database.connect(dsn, max_size=2)
    try:
        reader = await create_generator(reader_db, writers, "reader")
        async with db.transaction() as txn:
            held = await slow.get_next_txn(txn)  # 2: holds slow at 1
            async with fast.get_next_mult(3) as ids, db.connection() as conn:  # 3, 4, 5
                await conn.execute(
                    "INSERT INTO events (stream_id, instance_name)"
                    " SELECT unnest(%s::bigint[]), 'fast'",
                    (ids,),
                )
            await fast.flush_position()
            await reader.refresh_positions()  # positions moved: no query for rows yet
            load = reader.store.load_positions

            async def load_then_lose_the_connection(*args: Any, **kwargs: Any) -> Any:
                positions = await load(*args, **kwargs)
                async with reader_db.connection() as conn:  # the one the next read takes
                    pid = conn.info.backend_pid
                async with db.connection() as conn:
                    await conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
                return positions

            reader.store.load_positions = load_then_lose_the_connection  # type: ignore[method-assign]
            await reader.refresh_positions()  # stood still: reads the IDs above it
            assert reader_db.connections_lost == 1
            assert reader.get_current_token() == 1  # 2 is held
            await txn.execute("INSERT INTO events VALUES (%s, 'slow')", (held,))
        await slow.flush_position()
        reader.store.load_positions = load  # type: ignore[method-assign]
        await reader.refresh_positions()
        assert reader.get_current_token() == 5
        await reader.close()
    finally:
        await reader_db.close()
    await slow.close()
    await fast.close()
