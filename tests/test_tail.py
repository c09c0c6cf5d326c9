"""`plait tail` on a real database: every persisted row once, in ID order across the
stream's tables, tokens that resume exactly after their row, a writer filter, and
`--follow` printing rows written after it started."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import psycopg
from click.testing import CliRunner

import pace
from plait import Database, MultiWriterIdGenerator
from plait.cli import main
from plait.ops.tail import Tail
from stream_helpers import create_generator, create_table

TABLES = ("events", "state")


def insert(table: str) -> str:
    return (
        f"INSERT INTO {table} (stream_id, instance_name, payload)"
        " SELECT {id}, %s, %s || g FROM generate_series(1, %s) g RETURNING stream_id"
    )


async def write(gen: MultiWriterIdGenerator, table: str, count: int) -> list[int]:
    ids = await gen.insert(insert(table), (gen.instance_name, table, count))
    await gen.flush_position()
    return list(ids)


def tail(dsn: str, *args: str) -> list[dict[str, Any]]:
    result = CliRunner().invoke(main, ["tail", "events", "--dsn", dsn, *args])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.output.splitlines()]


async def test_tail_prints_each_row_once_and_its_tokens_resume_after_it(db: Database) -> None:
    for table in TABLES:
        await create_table(db, table)
    w1 = await create_generator(db, ["w1", "w2"], "w1", tables=TABLES)
    w2 = await create_generator(db, ["w1", "w2"], "w2", tables=TABLES)
    try:
        ids: list[int] = []
        for round_ in range(3):  # interleaved writers and tables
            ids += await write(w1, TABLES[round_ % 2], 3)
            ids += await write(w2, TABLES[(round_ + 1) % 2], 2)
        lines = await asyncio.to_thread(tail, db.dsn, "--from", "earliest")
        assert [line["row"]["stream_id"] for line in lines] == sorted(ids)
        assert {line["table"] for line in lines} == set(TABLES)
        for k in (0, 4, len(lines) - 1):  # each token: exactly the rows after its own
            rest = await asyncio.to_thread(tail, db.dsn, "--from", lines[k]["token"])
            assert [line["row"]["stream_id"] for line in rest] == sorted(ids)[k + 1 :]
        last = await asyncio.to_thread(tail, db.dsn, "-n", "4")
        assert [line["row"]["stream_id"] for line in last] == sorted(ids)[-4:]
        assert last[-1]["token"] == lines[-1]["token"]
        only = await asyncio.to_thread(tail, db.dsn, "--from", "earliest", "--writer", "w2")
        assert {line["row"]["instance_name"] for line in only} == {"w2"}
        assert len(only) == 6

        def paged() -> list[int]:  # pages of 2 rows per table, merged in ID order
            with psycopg.connect(db.dsn, autocommit=True) as conn:
                reader = Tail(conn, "events")
                start = reader.token("earliest")
                return [line.id for line in reader.between(start, reader.latest(), page=2)]

        assert await asyncio.to_thread(paged) == sorted(ids)
    finally:
        await w1.close()
        await w2.close()


async def test_tail_follow_prints_rows_written_after_it_started(db: Database) -> None:
    for table in TABLES:
        await create_table(db, table)
    w1 = await create_generator(db, ["w1"], "w1", tables=TABLES)
    before = await write(w1, "events", 2)
    [newest] = await asyncio.to_thread(tail, db.dsn, "-n", "1")
    follower = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "plait.cli", "tail", "events", "--dsn", db.dsn,
        "--from", newest["token"], "--follow", "--every", "0.1",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await asyncio.sleep(0.5)  # most likely started: the rows come either way
        after = await write(w1, "state", 3)
        got: list[int] = []
        assert follower.stdout is not None
        while len(got) < 3:
            line = await pace.wait(follower.stdout.readline(), 20, "a row from plait tail -f")
            got.append(json.loads(line)["row"]["stream_id"])
        assert got == after
        assert not set(got) & set(before)
    finally:
        follower.terminate()
        await pace.wait(follower.wait(), 10, "plait tail -f to end on SIGTERM")
        await w1.close()


async def test_an_id_with_several_rows_is_never_split_or_skipped(db: Database) -> None:
    """Three rows under one ID in one table and one in the other, then a row under the
    next ID: pages of 1 and 2 rows still print all five, and resuming from a row in the
    middle of the ID prints its other rows again rather than skip them."""
    for table in TABLES:
        await create_table(db, table)
    w1 = await create_generator(db, ["w1"], "w1", tables=TABLES)
    try:
        async with w1.get_next() as shared, db.transaction() as txn:
            for table, body in (("events", "a"), ("events", "b"), ("state", "c"), ("events", "d")):
                await txn.execute(
                    f"INSERT INTO {table} (stream_id, instance_name, payload)"
                    " VALUES (%s, 'w1', %s)",
                    (shared, body),
                )
        (after,) = await write(w1, "events", 1)

        def read(page: int, since: str = "earliest") -> list[tuple[int, str]]:
            with psycopg.connect(db.dsn, autocommit=True) as conn:
                reader = Tail(conn, "events")
                lines = reader.between(reader.token(since), reader.latest(), page=page)
                return [(line.id, line.row["payload"]) for line in lines]

        everything = sorted([(shared, p) for p in "abcd"] + [(after, "events1")])
        for page in (1, 2, 1000):
            assert sorted(await asyncio.to_thread(read, page)) == everything
        lines = await asyncio.to_thread(tail, db.dsn, "--from", "earliest")
        assert [line["row"]["stream_id"] for line in lines] == [shared] * 4 + [after]
        middle = await asyncio.to_thread(tail, db.dsn, "--from", lines[1]["token"])
        assert len(middle) == 5  # the shared ID again, whole, then the next
        end_of_id = await asyncio.to_thread(tail, db.dsn, "--from", lines[3]["token"])
        assert [line["row"]["stream_id"] for line in end_of_id] == [after]
    finally:
        await w1.close()
