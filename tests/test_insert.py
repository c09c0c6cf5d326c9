"""Writes that take their stream IDs inside the statement: one round trip."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

import pace
from pg_proxy import answer_losing_proxy
from plait import ConfigError, Database, MultiWriterIdGenerator, StateError
from plait.replication.rows import DictRows
from plait.replication.streams import DatabaseStream
from stream_helpers import create_generator, create_table

ONE = "INSERT INTO events (stream_id, instance_name, payload) VALUES ({id}, %s, %s)"


async def test_insert_one_and_many(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    assert await gen.insert(ONE + " RETURNING stream_id", ("w", "a")) == [2]
    assert gen.get_current_token() == 2
    many = (
        "INSERT INTO events (stream_id, instance_name, payload)"
        " SELECT {id}, %s, p FROM unnest(%s::text[]) AS p RETURNING stream_id"
    )
    assert await gen.insert(many, ("w", ["b", "c", "d"])) == [3, 4, 5]
    assert gen.get_current_token() == 5
    rows, _, _ = await gen.get_updates_since("w", 0, 5)
    assert [(r.stream_id, r.data["payload"]) for r in rows] == [
        (2, "a"),
        (3, "b"),
        (4, "c"),
        (5, "d"),
    ]
    assert await gen.insert(many, ("w", [])) == []  # no rows, no IDs


async def test_insert_backwards(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w", backwards=True)
    ids = await gen.insert(
        "INSERT INTO events (stream_id, instance_name) VALUES ({id}, 'w'), ({id}, 'w')"
        " RETURNING stream_id"
    )
    assert ids == [-2, -3]
    assert gen.get_current_token() == -3


async def test_insert_txn_completes_after_commit_or_rollback(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    async with db.transaction() as txn:
        assert await gen.insert_txn(txn, ONE + " RETURNING stream_id", ("w", "x")) == [2]
        assert gen.get_current_token() == 1
    assert gen.get_current_token() == 2
    async with db.transaction() as txn:
        await gen.insert_txn(txn, ONE + " RETURNING stream_id", ("w", "y"))
        raise psycopg.Rollback
    # Rolled back: complete once the WAL was flushed (R-ID-14), a round trip later.
    await pace.until(lambda: gen.get_current_token() == 3, 10, "the rolled-back ID to complete")
    rows, _, _ = await gen.get_updates_since("w", 0, 3)
    assert [r.stream_id for r in rows] == [2]


async def test_insert_misuse_is_explained_and_never_stalls(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    with pytest.raises(ConfigError, match=r"write \{id\}"):
        await gen.insert("INSERT INTO events VALUES (1, 'w')")
    with pytest.raises(ConfigError, match="RETURNING"):
        await gen.insert(ONE, ("w", "no returning"))
    with pytest.raises(ConfigError, match="first column"):
        await gen.insert(ONE + " RETURNING payload", ("w", "text first"))
    with pytest.raises(ConfigError, match="first column"):
        await gen.insert(ONE + " RETURNING stream_id > 0", ("w", "bool first"))
    with pytest.raises(psycopg.errors.UndefinedColumn):
        await gen.insert("INSERT INTO events (nope) VALUES ({id}) RETURNING 1")
    # The misused statements that ran committed rows 2, 3 and 4 (the last one failed
    # while parsing, taking no ID); the position still moves past them.
    assert await gen.insert(ONE + " RETURNING stream_id", ("w", "ok")) == [5]
    assert gen.get_current_token() == 5
    rows, _, _ = await gen.get_updates_since("w", 0, 5)
    assert [r.stream_id for r in rows] == [2, 3, 4, 5]
    assert gen._tracker.fetches_in_flight() == 0


async def test_insert_with_commit_travels_with_commit_and_completes_after_it(
    db: Database,
) -> None:
    """Rows gathered during the transaction go out in one statement, in the round trip
    of COMMIT; their IDs are taken and completed only then."""
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    many = (
        "INSERT INTO events (stream_id, instance_name, payload)"
        " SELECT {id}, 'w', p FROM unnest(%s::text[]) AS p RETURNING *"
    )
    payloads: list[str] = []
    outbox = gen.open_outbox()
    async with db.transaction() as txn:
        await txn.execute("SELECT 1")
        gen.insert_with_commit(txn, many, lambda: (payloads,))
        payloads += ["a", "b"]  # read when COMMIT is sent
        assert gen._tracker.fetches_in_flight() == 0  # nothing sent yet
        payloads.append("c")
    # Whole rows came back with the IDs: the outbox holds them for replication.
    known = outbox.known(1, 4)
    assert known is not None
    assert [(stream_id, [r.data["payload"] for r in rows]) for stream_id, rows in known] == [
        (2, ["a"]),
        (3, ["b"]),
        (4, ["c"]),
    ]
    assert gen.get_current_token() == 4
    assert gen.get_last_completed_token() == 4
    # Without any other statement, the transaction is BEGIN, the insert, COMMIT.
    async with db.transaction() as txn:
        gen.insert_with_commit(txn, many, lambda: (["d"],))
    rows, _, _ = await gen.get_updates_since("w", 0, 5)
    assert [(r.stream_id, r.data["payload"]) for r in rows] == [
        (2, "a"),
        (3, "b"),
        (4, "c"),
        (5, "d"),
    ]
    with pytest.raises(StateError, match="ended already"):
        gen.insert_with_commit(txn, many, lambda: (["late"],))


async def test_insert_with_commit_that_fails_or_is_cut_off_leaves_nothing_in_flight(
    db: Database,
) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    bad = "INSERT INTO events (stream_id, instance_name, payload) VALUES ({id}, 'w', %s)" + (
        " RETURNING stream_id"
    )
    async with db.connection() as conn:
        await conn.execute("ALTER TABLE events ADD CONSTRAINT short CHECK (length(payload) < 5)")
    with pytest.raises(psycopg.errors.CheckViolation):
        async with db.transaction() as txn:
            gen.insert_with_commit(txn, bad, lambda: ("too long",))
    # The connection breaks before COMMIT answers: plait waits until its server process
    # is gone (then nothing of it can still commit) and moves on.

    async def cut_off() -> None:
        async with db.transaction() as txn:
            cursor = await txn.execute("SELECT pg_backend_pid()")
            pid = (await cursor.fetchone() or (0,))[0]
            gen.insert_with_commit(txn, bad, lambda: ("cut",))
            async with db.connection() as other:
                await other.execute("SELECT pg_terminate_backend(%s)", (pid,))

    with pytest.raises(psycopg.OperationalError):
        await cut_off()
    assert gen._tracker.fetches_in_flight() == 0
    (last,) = await gen.insert(bad, ("ok",))
    assert gen.get_current_token() == last  # past the IDs the failed statements took
    rows, _, _ = await gen.get_updates_since("w", 0, last)
    assert [r.data["payload"] for r in rows] == ["ok"]


async def _settled(gen: MultiWriterIdGenerator) -> None:
    for _ in range(200):
        if gen._tracker.fetches_in_flight() == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the failed write's fetch never ended")


@pytest.mark.parametrize("how", ["with_commit", "autocommit", "no_returning"])
async def test_a_write_whose_answer_was_lost_is_read_back_not_skipped(dsn: str, how: str) -> None:
    """The server committed, the connection broke before the answer came back (or the
    statement returned no IDs). The writer cannot name the IDs it took, so replication
    must read the range they lie in back rather than announce it empty: readers would
    skip the row for good."""
    insert = (
        "INSERT INTO events (stream_id, instance_name, payload) VALUES ({id}, 'w', %s) RETURNING *"
    )
    async with answer_losing_proxy(dsn) as (proxy, through):
        db = await Database.connect(through, max_size=4)
        try:
            await db.migrate()
            await create_table(db)
            gen = await create_generator(db, ["w"], "w")
            stream = DatabaseStream(gen, DictRows())
            stream.open_outbox()
            start = stream.own_position()
            assert start is not None

            async def lose_commit() -> None:
                async with db.transaction() as txn:
                    await txn.execute("SELECT 1")
                    gen.insert_with_commit(txn, insert, lambda: ("lost",))
                    proxy.lose_next_answer()

            async def lose_insert() -> None:
                proxy.lose_next_answer()
                await gen.insert(insert, ("lost",))

            if how == "no_returning":
                with pytest.raises(ConfigError, match="RETURNING"):
                    await gen.insert(insert.removesuffix(" RETURNING *"), ("lost",))
            else:
                with pytest.raises(psycopg.OperationalError):
                    await (lose_commit() if how == "with_commit" else lose_insert())
                assert proxy.answers_lost == 1
            await _settled(gen)
            head = await gen.get_max_allocated_token()
            rows, _, _ = await gen.get_updates_since("w", 0, head)
            assert [r.data["payload"] for r in rows] == ["lost"]  # it did commit
            await gen.insert(insert, ("ok",))  # known rows, after the unknown one
            position = stream.own_position()
            assert position is not None
            page = await stream.read_own(start, position)
            assert [row["payload"] for _, row in page.rows] == ["lost", "ok"]
            await gen.close()
        finally:
            await db.close()
