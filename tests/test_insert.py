"""Writes that take their stream IDs inside the statement: one round trip."""

from __future__ import annotations

import psycopg
import pytest

from plait import ConfigError, Database
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
    assert gen.get_current_token() == 3
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
    written: list[tuple[list[int], int]] = []
    gen.capture_writes(lambda ids, rows: written.append((ids, len(rows or []))))
    async with db.transaction() as txn:
        await txn.execute("SELECT 1")
        gen.insert_with_commit(txn, many, lambda: (payloads,))
        payloads += ["a", "b"]  # read when COMMIT is sent
        assert gen._tracker.fetches_in_flight() == 0  # nothing sent yet
        payloads.append("c")
    assert written == [([2, 3, 4], 3)]  # whole rows came back with the IDs
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
    with pytest.raises(psycopg.ProgrammingError, match="ended already"):
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
