"""The acceptance scenarios of SPEC.md section 3, with exactly its numbers, on real PostgreSQL."""

from __future__ import annotations

import logging

import pytest

from plait import Database, MultiWriterIdGenerator
from stream_helpers import (
    create_generator,
    create_table,
    insert_row_with_id,
    insert_rows,
    stored_positions,
)


async def test_empty_database_single_writer(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master")
    assert gen.get_positions() == {"master": 1}
    assert gen.get_current_token() == 1
    assert await stored_positions(db) == {"master": 1}


async def test_existing_rows_position_and_next_id(db: Database) -> None:
    await create_table(db)
    await insert_rows(db, "master", 7)
    gen = await create_generator(db, ["master"], "master")
    assert gen.get_positions() == {"master": 7}
    assert gen.get_current_token_for_writer("master") == 7
    async with gen.get_next() as stream_id:
        assert stream_id == 8
        assert gen.get_positions() == {"master": 7}
        assert gen.get_current_token() == 7
    assert gen.get_positions() == {"master": 8}
    assert gen.get_current_token() == 8


async def test_out_of_order_completion(db: Database) -> None:
    await create_table(db)
    await insert_rows(db, "master", 7)
    gen = await create_generator(db, ["master"], "master")
    contexts = [gen.get_next() for _ in range(4)]
    ids = [await ctx.__aenter__() for ctx in contexts]
    assert ids == [8, 9, 10, 11]
    seen = []
    for index in (1, 0, 3, 2):  # finish 9, 8, 11, 10
        await contexts[index].__aexit__(None, None, None)
        seen.append(gen.get_positions()["master"])
        assert gen.get_current_token_for_writer("master") == seen[-1]
    assert seen == [7, 9, 9, 11]


async def test_restart_mid_write(db: Database) -> None:
    await create_table(db)
    await insert_rows(db, "master", 7)
    writer = await create_generator(db, ["master"], "master")
    first, second = writer.get_next(), writer.get_next()
    assert await first.__aenter__() == 8
    assert await second.__aenter__() == 9
    async with db.transaction() as txn:
        await txn.execute("INSERT INTO events (stream_id, instance_name) VALUES (9, 'master')")
    await second.__aexit__(None, None, None)
    assert writer.get_positions() == {"master": 7}

    reader = await create_generator(db, ["master"], "worker")  # a restarted reader
    assert reader.get_positions() == {"master": 7}
    assert reader.get_current_token_for_writer("master") == 7
    assert reader.get_current_token() == 7

    await first.__aexit__(None, None, None)
    assert writer.get_positions() == {"master": 9}
    reader.advance("master", 9)
    assert reader.get_positions() == {"master": 9}
    assert reader.get_current_token() == 9


async def test_reader_persisted_upto_with_gaps(db: Database) -> None:
    await create_table(db)
    await insert_row_with_id(db, "first", 3)
    await insert_row_with_id(db, "second", 5)
    reader = await create_generator(db, ["first", "second"], "worker")
    assert reader.get_positions() == {"first": 3, "second": 5}
    assert reader.get_persisted_upto_position() == 3
    steps = [("first", 6, 6), ("second", 7, 7), ("second", 9, 7), ("first", 8, 9)]
    for writer, position, expected in steps:
        reader.advance(writer, position)
        assert reader.get_persisted_upto_position() == expected, (writer, position)
    reader.advance("first", 11)
    reader.advance("second", 15)
    assert reader.get_persisted_upto_position() == 11


async def test_restarted_writer_reads_agree(db: Database) -> None:
    """Synapse's test_get_persisted_upto_position_get_next, ported: a restarted writer
    whose sequence head is known complete is at that head, in every read."""
    await create_table(db)
    await insert_row_with_id(db, "first", 3)
    await insert_row_with_id(db, "second", 5)
    gen = await create_generator(db, ["first", "second"], "first")
    assert gen.get_positions() == {"first": 5, "second": 5}
    assert gen.get_current_token_for_writer("first") == 5
    assert gen.get_persisted_upto_position() == 5
    async with gen.get_next() as stream_id:
        assert stream_id == 6
        assert gen.get_persisted_upto_position() == 5
        assert gen.get_positions() == {"first": 5, "second": 5}
    assert gen.get_persisted_upto_position() == 6
    assert gen.get_positions() == {"first": 6, "second": 5}
    assert gen.get_minimal_local_current_token() == 6


async def test_two_writers_after_replication(db: Database) -> None:
    await create_table(db)
    await insert_rows(db, "first", 3)  # IDs 1..3
    first = await create_generator(db, ["first", "second"], "first")
    await insert_rows(db, "second", 4)  # IDs 4..7
    second = await create_generator(db, ["first", "second"], "second")

    for source in (first, second):  # replication: each learns the other's position
        for target in (first, second):
            if target is not source:
                name = source.instance_name
                target.advance(name, source.get_current_token_for_writer(name))

    assert first.get_positions() == {"first": 3, "second": 7}
    assert second.get_positions() == {"first": 3, "second": 7}
    for gen in (first, second):
        assert gen.get_current_token_for_writer("first") == 7
        assert gen.get_current_token_for_writer("second") == 7

    async with first.get_next() as stream_id:
        assert stream_id == 8
        assert first.get_positions() == {"first": 3, "second": 7}
        assert first.get_persisted_upto_position() == 7
    assert first.get_positions() == {"first": 8, "second": 7}
    async with second.get_next() as stream_id:
        assert stream_id == 9
    assert second.get_positions() == {"first": 3, "second": 9}
    second.advance("first", 8)
    assert second.get_positions() == {"first": 8, "second": 9}


async def test_writer_config_change(db: Database) -> None:
    await create_table(db)
    await insert_row_with_id(db, "first", 3)
    await insert_row_with_id(db, "second", 5)

    both = await create_generator(db, ["first", "second"], "worker")
    assert both.get_persisted_upto_position() == 3
    assert both.get_current_token_for_writer("first") == 3
    assert both.get_current_token_for_writer("second") == 5

    # "first" was removed from the config: it is assumed stopped and finished.
    only_second = await create_generator(db, ["second"], "second")
    assert only_second.get_persisted_upto_position() == 5
    assert only_second.get_current_token_for_writer("second") == 5

    third = await create_generator(db, ["third"], "third")  # a brand new writer
    assert third.get_persisted_upto_position() == 5
    assert third.get_current_token_for_writer("third") == 5
    fourth = await create_generator(db, ["third"], "fourth")
    assert fourth.get_current_token_for_writer("third") == 5

    async with third.get_next() as stream_id:
        assert stream_id == 6
    assert third.get_current_token_for_writer("third") == 6
    await third.flush_position()

    # Adding "first" back does not drag anything back to 3.
    fifth = await create_generator(db, ["first", "third"], "five")
    assert fifth.get_persisted_upto_position() == 6
    assert fifth.get_current_token_for_writer("first") == 6
    assert fifth.get_current_token_for_writer("third") == 6


async def test_idle_writer_rule(db: Database) -> None:
    await create_table(db)
    await insert_rows(db, "first", 3)
    await insert_rows(db, "second", 4)
    writers = ["first", "second", "third"]
    first = await create_generator(db, writers, "first")
    second = await create_generator(db, writers, "second")
    assert second.get_current_token_for_writer("first") == 7
    assert second.get_current_token_for_writer("second") == 7
    assert second.get_current_token() == 7

    async with first.get_next_mult(2) as ids:
        assert ids == [8, 9]
    second.advance("first", 9)
    # Nothing in flight: "second" reports itself at 9; 8 was never seen, so the
    # linear position stays at 7.
    assert second.get_current_token_for_writer("first") == 9
    assert second.get_current_token_for_writer("second") == 9
    assert second.get_current_token() == 7

    async with first.get_next_mult(2) as ids:
        assert ids == [10, 11]
    in_flight = second.get_next()
    assert await in_flight.__aenter__() == 12
    second.advance("first", 11)
    assert second.get_current_token_for_writer("first") == 11
    assert second.get_current_token_for_writer("second") == 9  # a local write is in flight
    assert second.get_current_token() == 7
    await in_flight.__aexit__(None, None, None)
    assert second.get_current_token_for_writer("first") == 11
    assert second.get_current_token_for_writer("second") == 12
    assert second.get_current_token() == 7


async def test_sequence_repair(db: Database, caplog: pytest.LogCaptureFixture) -> None:
    await create_table(db)
    async with db.connection() as conn:
        await conn.execute(
            "INSERT INTO events (stream_id, instance_name)"
            " SELECT g, 'master' FROM generate_series(1, 26) g"
        )
        await conn.execute("CREATE SEQUENCE events_seq")
        await conn.execute("SELECT setval('events_seq', 3)")
    with caplog.at_level(logging.WARNING, logger="plait"):
        gen = await create_generator(db, ["master"], "master")
    assert any("moving the sequence up to 26" in r.getMessage() for r in caplog.records)
    async with gen.get_next() as stream_id:
        assert stream_id == 27


async def test_backwards_stream(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["master"], "master", backwards=True)
    assert gen.get_positions() == {"master": -1}
    async with gen.get_next() as stream_id:
        assert stream_id == -2
        async with db.transaction() as txn:
            await txn.execute(
                "INSERT INTO events (stream_id, instance_name) VALUES (%s, 'master')", (stream_id,)
            )
    assert gen.get_positions() == {"master": -2}
    async with gen.get_next_mult(3) as ids:
        assert ids == [-3, -4, -5]
    assert gen.get_positions() == {"master": -5}
    assert gen.get_current_token() == -5
    await gen.close()
    assert await stored_positions(db) == {"master": -5}

    again = await create_generator(db, ["master"], "master", backwards=True)
    assert again.get_positions() == {"master": -5}
    assert again.get_current_token() == -5


async def test_two_tables_row_missing_from_positions(db: Database) -> None:
    await create_table(db, "first_table")
    await create_table(db, "second_table")
    await insert_rows(db, "first", 3, table="first_table")  # IDs 1..3
    await insert_rows(db, "second", 4, table="second_table")  # IDs 4..7
    await insert_rows(db, "second", 1, table="second_table", update_positions=False)  # ID 8
    tables = ("first_table", "second_table")
    first = await create_generator(db, ["first", "second"], "first", tables=tables)
    second = await create_generator(db, ["first", "second"], "second", tables=tables)

    # "first" starts at 8 (row 8 found, nothing of its own pending), in every read.
    assert first.get_positions() == {"first": 8, "second": 7}
    assert first.get_persisted_upto_position() == 8  # row 8 was found in second_table
    assert first.get_current_token_for_writer("first") == 8
    assert first.get_current_token_for_writer("second") == 8
    # "first" registered itself at its idle-advanced position (8) when it started.
    assert second.get_positions() == {"first": 8, "second": 8}
    assert second.get_persisted_upto_position() == 8
    assert second.get_current_token_for_writer("second") == 8


async def test_new_generator_is_a_writer_only_if_configured(db: Database) -> None:
    await create_table(db)
    reader = await MultiWriterIdGenerator.create(
        db, (await create_generator(db, ["master"], "master")).spec, "worker"
    )
    assert not reader.is_writer
    assert await stored_positions(db) == {"master": 1}
