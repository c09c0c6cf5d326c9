"""get_updates_since on real tables: per writer, linear, paged, several tables, backwards."""

from __future__ import annotations

from plait import Database, MultiWriterIdGenerator, StreamRow
from stream_helpers import create_generator, create_table


async def write(db: Database, table: str, rows: list[tuple[int, str]]) -> None:
    async with db.transaction() as txn:
        for stream_id, instance in rows:
            await txn.execute(
                f"INSERT INTO {table} (stream_id, instance_name, payload) VALUES (%s, %s, %s)",
                (stream_id, instance, f"{table}:{stream_id}"),
            )


async def read_all(
    gen: MultiWriterIdGenerator, writer: str | None, low: int, high: int, limit: int
) -> list[StreamRow]:
    """Page through (low, high] as a reader would, checking every page's contract."""
    got: list[StreamRow] = []
    position = low
    while True:
        rows, upto, limited = await gen.get_updates_since(writer, position, high, limit)
        ids = [gen.spec.sign * r.stream_id for r in rows]  # stream order
        assert ids == sorted(ids)
        sign = gen.spec.sign
        assert all(sign * position < i <= sign * upto for i in ids)
        got.extend(rows)
        if not limited:
            assert upto == high
            return got
        assert sign * upto > sign * position
        position = upto


async def test_per_writer_and_linear_reads(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["a", "b"], "reader")
    await write(db, "events", [(i, "a" if i % 3 else "b") for i in range(2, 300)])
    a_rows = await read_all(gen, "a", 1, 299, limit=7)
    assert [r.stream_id for r in a_rows] == [i for i in range(2, 300) if i % 3]
    assert {r.instance_name for r in a_rows} == {"a"}
    assert a_rows[0].data["payload"] == "events:2"
    assert a_rows[0].table == "events"
    every = await read_all(gen, None, 1, 299, limit=50)
    assert [r.stream_id for r in every] == list(range(2, 300))
    rows, upto, limited = await gen.get_updates_since("a", 10, 20)
    assert [r.stream_id for r in rows] == [11, 13, 14, 16, 17, 19, 20]
    assert (upto, limited) == (20, False)
    assert await gen.get_updates_since("a", 20, 20) == ([], 20, False)


async def test_two_tables_merged_under_one_upto(db: Database) -> None:
    await create_table(db, "ta")
    await create_table(db, "tb")
    gen = await create_generator(db, ["w"], "reader", tables=("ta", "tb"))
    # ta has every ID 2..251; tb has every third ID, several rows for some IDs.
    await write(db, "ta", [(i, "w") for i in range(2, 252)])
    await write(db, "tb", [(i, "w") for i in range(2, 252, 3)] + [(50, "w")] * 4)
    rows = await read_all(gen, "w", 1, 251, limit=100)
    expected = sorted(
        [(i, "ta") for i in range(2, 252)]
        + [(i, "tb") for i in range(2, 252, 3)]
        + [(50, "tb")] * 4
    )
    assert sorted((r.stream_id, r.table) for r in rows) == expected
    assert [r.stream_id for r in rows] == sorted(r.stream_id for r in rows)


async def test_one_id_with_more_rows_than_the_limit(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "reader")
    await write(db, "events", [(5, "w")] * 30 + [(6, "w"), (7, "w")])
    rows = await read_all(gen, "w", 1, 10, limit=10)
    assert [r.stream_id for r in rows] == [5] * 30 + [6, 7]


async def test_backwards_stream_reads(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "reader", backwards=True)
    await write(db, "events", [(-i, "w") for i in range(2, 40)])
    rows = await read_all(gen, "w", -1, -39, limit=9)
    assert [r.stream_id for r in rows] == [-i for i in range(2, 40)]
    rows, upto, limited = await gen.get_updates_since("w", -5, -8)
    assert [r.stream_id for r in rows] == [-6, -7, -8]
    assert (upto, limited) == (-8, False)


async def scan_all(
    gen: MultiWriterIdGenerator, writer: str, low: int, high: int, first: int, most: int
) -> list[StreamRow]:
    """A catch-up's streaming read (internal domain), checking every page's contract:
    pages cut between IDs, each page's rows within (previous upto, upto]."""
    got: list[StreamRow] = []
    previous = low
    async for page in gen.store.rows.scan(writer, low, high, first, most):
        ids = [gen.spec.sign * r.stream_id for r in page.rows]
        assert ids == sorted(ids)
        assert all(previous < i <= page.upto for i in ids)
        if not page.limited:
            assert page.upto == high
        got.extend(page.rows)
        previous = page.upto
    assert previous == high
    return got


async def test_streaming_read_keeps_the_rows_of_an_id_together_across_batches(
    db: Database,
) -> None:
    await create_table(db)
    gen = await create_generator(db, ["a", "b"], "reader")
    # IDs with 1, 2 or 3 rows each, and another writer's rows in between.
    rows = []
    for stream_id in range(2, 60):
        writer = "b" if stream_id % 7 == 0 else "a"
        rows += [(stream_id, writer)] * (1 + stream_id % 3)
    await write(db, "events", rows)
    mine = [r for r in rows if r[1] == "a"]
    for first, most in ((1, 1), (2, 4), (3, 3), (5, 100), (100, 100)):
        got = await scan_all(gen, "a", 1, 59, first, most)
        assert [(r.stream_id, r.instance_name) for r in got] == mine, (first, most)
        assert [r.data["payload"] for r in got] == [f"events:{i}" for i, _ in mine]
    part = await scan_all(gen, "a", 20, 40, 2, 2)
    assert [r.stream_id for r in part] == [i for i, _ in mine if 20 < i <= 40]


async def test_streaming_read_of_a_backwards_stream(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["a"], "reader", backwards=True)
    rows = [(-i, "a") for i in range(2, 30) for _ in range(1 + i % 2)]
    await write(db, "events", rows)
    got = await scan_all(gen, "a", 1, 29, 2, 8)
    assert [(r.stream_id, r.instance_name) for r in got] == rows


async def test_streaming_read_of_two_tables_merges_them_in_id_order(db: Database) -> None:
    await create_table(db, "events")
    await create_table(db, "extra")
    gen = await create_generator(db, ["a", "b"], "reader", tables=("events", "extra"))
    # IDs with rows in one table, the other, or both (some with two rows), and rows of
    # another writer in between.
    rows_events, rows_extra = [], []
    for stream_id in range(2, 80):
        writer = "b" if stream_id % 9 == 0 else "a"
        if stream_id % 3 != 1:
            rows_events += [(stream_id, writer)] * (1 + stream_id % 2)
        if stream_id % 3 != 2:
            rows_extra.append((stream_id, writer))
    await write(db, "events", rows_events)
    await write(db, "extra", rows_extra)
    expected = sorted(
        [(i, "events") for i, w in rows_events if w == "a"]
        + [(i, "extra") for i, w in rows_extra if w == "a"]
    )
    for first, most in ((1, 1), (2, 4), (3, 7), (100, 100)):
        got = await scan_all(gen, "a", 1, 79, first, most)
        assert [(r.stream_id, r.table) for r in got] == expected, (first, most)
    part = await scan_all(gen, "a", 30, 50, 2, 2)
    assert [(r.stream_id, r.table) for r in part] == [e for e in expected if 30 < e[0] <= 50]


async def test_streaming_read_of_two_tables_of_a_backwards_stream(db: Database) -> None:
    await create_table(db, "events")
    await create_table(db, "extra")
    gen = await create_generator(db, ["a"], "reader", tables=("events", "extra"), backwards=True)
    rows_events = [(-i, "a") for i in range(2, 40) if i % 3 != 1]
    rows_extra = [(-i, "a") for i in range(2, 40) if i % 3 != 2 for _ in range(1 + i % 2)]
    await write(db, "events", rows_events)
    await write(db, "extra", rows_extra)
    expected = sorted(
        [(-i, "events") for i, _ in rows_events] + [(-i, "extra") for i, _ in rows_extra]
    )
    got = await scan_all(gen, "a", 1, 39, 2, 5)
    assert [(-r.stream_id, r.table) for r in got] == expected
