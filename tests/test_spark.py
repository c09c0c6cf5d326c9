"""The plait data source in a real local Spark, on a real PostgreSQL (SPEC §8): batch
reads between tokens, streaming reads that no idle or slow writer holds back, exactly
once across a restart, and clear errors for bad options. One SparkSession serves every
test (the `spark` fixture)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pace
import plait.spark
from conftest import with_search_path
from pg_proxy import proxy_in_front
from plait import ConfigError, Database, MultiWriterIdGenerator, StreamToken
from plait.spark import kept
from stream_helpers import create_generator, create_table, spec_for

pytestmark = pytest.mark.timeout(240)

INSERT = (
    "INSERT INTO events (stream_id, instance_name, payload, amount)"
    " SELECT {id}, %s, %s || g, g * 1.25 FROM generate_series(1, %s) g RETURNING stream_id"
)


async def create_events(db: Database) -> None:
    async with db.connection() as conn:
        await conn.execute(
            "CREATE TABLE events (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
            " payload TEXT, amount NUMERIC(12,2), at TIMESTAMPTZ NOT NULL DEFAULT now(),"
            " extra JSONB); CREATE INDEX ON events (instance_name, stream_id)"
        )


@contextlib.asynccontextmanager
async def writers(
    db: Database, *names: str, all_writers: list[str]
) -> AsyncIterator[dict[str, MultiWriterIdGenerator]]:
    gens = {
        name: await create_generator(db, all_writers, name, position_flush_interval=0.2)
        for name in names
    }
    try:
        yield gens
    finally:
        for gen in gens.values():
            await gen.close()


async def write(gen: MultiWriterIdGenerator, prefix: str, count: int) -> list[int]:
    ids = await gen.insert(INSERT, (gen.instance_name, prefix, count))
    await gen.flush_position()  # what database-only readers (Spark) go by
    return ids


def reader(spark: Any, dsn: str, **options: Any) -> Any:
    read = spark.read.format("plait").option("dsn", dsn).option("stream", "events")
    for key, value in options.items():
        read = read.option(key, value)
    return read


async def test_a_batch_read_between_two_tokens_returns_exactly_those_rows(
    db: Database, spark: Any
) -> None:
    await create_events(db)
    async with writers(db, "w1", "w2", all_writers=["w1", "w2"]) as gens:
        before = await write(gens["w1"], "a", 5) + await write(gens["w2"], "b", 3)
        t1 = await _token(db, gens)
        between = await write(gens["w2"], "c", 4) + await write(gens["w1"], "d", 6)
        t2 = await _token(db, gens)
        after = await write(gens["w1"], "e", 2)

        def ids(df: Any) -> list[int]:
            return sorted(row.stream_id for row in df.select("stream_id").collect())

        got = await asyncio.to_thread(ids, reader(spark, db.dsn, startToken=t1, endToken=t2).load())
        assert got == sorted(between)
        # Cut into slices of 3 IDs, most holding part of one writer's range only.
        sliced = reader(spark, db.dsn, startToken=t1, endToken=t2, maxIdsPerPartition="3").load()
        assert await asyncio.to_thread(lambda: sliced.rdd.getNumPartitions()) >= 4
        assert await asyncio.to_thread(ids, sliced) == sorted(between)
        # A task per writer range (SPEC R-SP-1's layout), pieces of at most 3 IDs.
        per_writer = reader(
            spark,
            db.dsn,
            startToken=t1,
            endToken=t2,
            partitioning="writers",
            maxIdsPerPartition="3",
        ).load()
        assert await asyncio.to_thread(lambda: per_writer.rdd.getNumPartitions()) >= 4
        assert await asyncio.to_thread(ids, per_writer) == sorted(between)
        everything = reader(spark, db.dsn).load()
        assert await asyncio.to_thread(ids, everything) == sorted(before + between + after)
        row = (await asyncio.to_thread(everything.where("stream_id = 2").collect))[0]
        assert (row.instance_name, row.payload, str(row.amount)) == ("w1", "a1", "1.25")
        fields = {f.name: f.dataType.simpleString() for f in everything.schema.fields}
        assert fields == {
            "stream_id": "bigint",
            "instance_name": "string",
            "payload": "string",
            "amount": "decimal(12,2)",
            "at": "timestamp",
            "extra": "string",
        }


async def _token(db: Database, gens: dict[str, MultiWriterIdGenerator]) -> str:
    """The text form of the token of everything written so far."""
    positions = {name: gen.get_current_token_for_writer(name) for name, gen in gens.items()}
    token = StreamToken.normalised(min(positions.values()), positions)
    return await token.to_string(db)


async def until(condition: Callable[[], bool], what: str, within: float = 60.0) -> None:
    """`pace.until` for a `condition` that asks Spark (blocking: in a thread)."""
    await pace.until(lambda: asyncio.to_thread(condition), within, what, every=0.2)


async def test_a_stream_is_never_held_back_by_a_slow_idle_or_late_writer(
    db: Database, spark: Any
) -> None:
    """w2 holds a transaction open for seconds, w3 never writes, w4 starts after the
    query did: w1's rows flow meanwhile, and every row arrives once."""
    await create_events(db)
    names = ["w1", "w2", "w3", "w4"]
    async with writers(db, "w1", "w2", "w3", all_writers=names) as gens:
        first = await write(gens["w1"], "a", 3)
        query = (
            spark.readStream.format("plait")
            .option("dsn", db.dsn)
            .option("stream", "events")
            .option("startingToken", "earliest")
            .load()
            .writeStream.format("memory")
            .queryName("never_held_back")
            .trigger(processingTime="200 milliseconds")
            .start()
        )
        try:

            def seen() -> list[int]:
                rows = spark.sql("SELECT stream_id FROM never_held_back").collect()
                return [row.stream_id for row in rows]

            await until(lambda: len(seen()) >= 3, "w1's first 3 rows in the query's output")
            held: list[int] = []
            async with db.transaction() as txn:
                stream_id = await gens["w2"].get_next_txn(txn)
                await txn.execute(
                    "INSERT INTO events (stream_id, instance_name, payload)"
                    " VALUES (%s, 'w2', 'held')",
                    (stream_id,),
                )
                held.append(stream_id)
                flowing = await write(gens["w1"], "b", 4)  # above the held ID
                await until(lambda: set(flowing) <= set(seen()), "w1's rows above w2's held ID")
                assert stream_id not in seen()
            await gens["w2"].flush_position()
            await until(lambda: stream_id in seen(), "w2's row, once committed")
            async with writers(db, "w4", all_writers=names) as late:
                latecomer = await write(late["w4"], "z", 2)
                await until(lambda: set(latecomer) <= set(seen()), "the rows of w4, started late")
            got = seen()
            assert sorted(got) == sorted(first + held + flowing + latecomer)  # each once
        finally:
            query.stop()


async def test_exactly_once_across_a_restart_of_the_query(
    db: Database, spark: Any, tmp_path: Path
) -> None:
    """A Parquet sink with a checkpoint, run with Trigger.AvailableNow and a read limit,
    stopped, written to, and run again: every row once."""
    await create_events(db)
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"

    def run() -> list[int]:
        query = (
            spark.readStream.format("plait")
            .option("dsn", db.dsn)
            .option("stream", "events")
            .option("maxRowsPerTrigger", 40)
            .load()
            .writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        return [p.numInputRows for p in query.recentProgress]

    async with writers(db, "w1", "w2", all_writers=["w1", "w2"]) as gens:
        written = await write(gens["w1"], "a", 70) + await write(gens["w2"], "b", 30)
        batches = await asyncio.to_thread(run)
        assert sum(batches) == 100
        assert max(batches) <= 40  # the read limit held
        written += await write(gens["w2"], "c", 25) + await write(gens["w1"], "d", 5)
        assert sum(await asyncio.to_thread(run)) == 30
        assert sum(await asyncio.to_thread(run)) == 0  # nothing new: nothing read again
    rows = await asyncio.to_thread(lambda: spark.read.parquet(str(out)).collect())
    assert sorted(row.stream_id for row in rows) == sorted(written)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stream": "nope"}, "unknown stream 'nope'; streams in this database: ['events']"),
        ({"startToken": "m1~x"}, "bad startToken 'm1~x': malformed token"),
        ({"endToken": '{"min": 1'}, "bad endToken '{\"min\": 1': offset is not valid JSON"),
        ({"startToken": "m1~999.5"}, "instance id 999, which this database's instance_map"),
        ({"table": "other"}, "has no table 'other'; its tables: ['events']"),
        ({"maxIdsPerPartition": "-5"}, "maxIdsPerPartition must be a positive integer"),
        ({"partitioning": "rows"}, "partitioning must be one of ['slices', 'writers'], not 'rows'"),
        (
            {"minRowsPerTrigger": "5", "maxTriggerDelay": "5"},
            "maxTriggerDelay must be a duration such as 500ms, 30s",
        ),
        ({"maxTriggerDelay": "5s"}, "it does nothing without minRowsPerTrigger"),
        (
            {"minRowsPerTrigger": "50", "maxRowsPerTrigger": "10"},
            "minRowsPerTrigger (50) is above maxRowsPerTrigger (10)",
        ),
        ({"minOffsetsPerTrigger": "5"}, "(did you mean 'minRowsPerTrigger'?)"),
        ({"metadataColumns": "stream,offset"}, "metadataColumns names 'offset'; it takes"),
        ({"includeHeaders": "true"}, "(did you mean 'metadataColumns'?)"),
    ],
)
async def test_bad_options_fail_with_one_clear_message(
    db: Database, spark: Any, options: dict[str, str], message: str
) -> None:
    await create_events(db)
    async with writers(db, "w1", all_writers=["w1"]):
        pass
    given = {"stream": "events", **options}
    stream = given.pop("stream")
    with pytest.raises(ConfigError) as caught:
        await asyncio.to_thread(plait.spark.batch, spark, db.dsn, stream, **given)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
    # Through Spark's own reader the same text arrives, inside Spark's error.
    read = spark.read.format("plait").option("dsn", db.dsn).option("stream", stream)
    for key, value in given.items():
        read = read.option(key, value)
    with pytest.raises(Exception, match=re.escape(message)):  # Spark wraps it
        await asyncio.to_thread(lambda: read.load().collect())


async def test_a_database_without_plait_says_so(dsn: str, spark: Any) -> None:
    with pytest.raises(ConfigError, match="has no plait streams"):
        await asyncio.to_thread(plait.spark.batch, spark, dsn, "events")


async def test_a_backwards_stream_reads_its_negative_ids_in_batch_and_streaming(
    db: Database, spark: Any
) -> None:
    async with db.connection() as conn:
        await conn.execute(
            "CREATE TABLE backfill (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
            " payload TEXT); CREATE INDEX ON backfill (instance_name, stream_id)"
        )
    spec = spec_for(["w1"], tables=("backfill",), backwards=True, name="backfill")
    gen = await MultiWriterIdGenerator.create(db, spec, "w1")
    try:
        ids = await gen.insert(
            "INSERT INTO backfill SELECT {id}, 'w1', 'old' || g FROM generate_series(1, 30) g"
            " RETURNING stream_id"
        )
        await gen.flush_position()
    finally:
        await gen.close()
    assert all(i < 0 for i in ids)

    def read_all() -> list[int]:
        frame = plait.spark.batch(spark, db.dsn, "backfill")
        return sorted(row.stream_id for row in frame.collect())

    assert await asyncio.to_thread(read_all) == sorted(ids)
    assert db.dsn not in kept._KEPT  # the driver keeps no connection

    def stream_all() -> list[int]:
        query = (
            plait.spark.stream(spark, db.dsn, "backfill", maxRowsPerTrigger=7)
            .writeStream.format("memory")
            .queryName("backfill_rows")
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        return sorted(r.stream_id for r in spark.sql("SELECT * FROM backfill_rows").collect())

    assert await asyncio.to_thread(stream_all) == sorted(ids)


async def test_a_checkpoint_from_another_database_is_refused_saying_what_to_do(
    db: Database, spark: Any, tmp_path: Path, server_dsn: str
) -> None:
    """A streaming query's checkpoint, run against another database's stream of the same
    name (another deployment): the query fails saying so (the offsets name the stream's
    uid), neither waiting for IDs that may never come nor reading from the wrong place.
    (Offsets above the sequence head, of a checkpoint that names nothing: see
    test_spark_offsets.)"""
    await create_events(db)
    async with writers(db, "w1", all_writers=["w1"]) as gens:
        await write(gens["w1"], "a", 50)
    checkpoint = tmp_path / "checkpoint"

    def run(dsn: str) -> list[int]:
        query = (
            plait.spark.stream(spark, dsn, "events")
            .writeStream.format("parquet")
            .option("path", str(tmp_path / "out"))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        return [p.numInputRows for p in query.recentProgress]

    assert sum(await asyncio.to_thread(run, db.dsn)) == 50
    schema = f"plait_other_{uuid.uuid4().hex[:12]}"
    async with await psycopg.AsyncConnection.connect(server_dsn, autocommit=True) as conn:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    other = await Database.connect(with_search_path(server_dsn, schema))
    try:
        await other.migrate()
        await create_events(other)
        async with writers(other, "w1", all_writers=["w1"]) as gens:
            await write(gens["w1"], "b", 3)
        # Spark's StreamingQueryException, with the source's message inside
        with pytest.raises(Exception, match="the checkpoint's offset") as caught:
            await asyncio.to_thread(run, other.dsn)
        message = str(caught.value)
        assert "the checkpoint's offset" in message
        assert "it is an offset of stream 'events' (uid " in message
        assert "of another database, not of stream 'events' (uid " in message
        assert "delete the checkpoint" in message
    finally:
        await other.close()
        async with await psycopg.AsyncConnection.connect(server_dsn, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


def _collect_ids(spark: Any, frame: Any, group: str) -> list[int]:
    """The stream IDs of `frame`, read as Spark job group `group` (`_failed_tasks`)."""
    spark.sparkContext.setJobGroup(group, group)
    try:
        return [row.stream_id for row in frame.select("stream_id").collect()]
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)


def _failed_tasks(spark: Any, group: str) -> int:
    """Task attempts of job group `group` that failed (and were tried again)."""
    tracker = spark.sparkContext.statusTracker()
    jobs = [tracker.getJobInfo(job) for job in tracker.getJobIdsForGroup(group)]
    assert jobs, f"no Spark job of group {group!r}"
    stages = [tracker.getStageInfo(stage) for job in jobs if job for stage in job.stageIds]
    return sum(stage.numFailedTasks for stage in stages if stage)


async def _terminate_readers(db: Database) -> int:
    """End the connections that read rows of `events` for Spark (what a PostgreSQL
    restart, a failover or an idle timeout does to them)."""
    async with db.connection() as conn:
        cur = await conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE pid <> pg_backend_pid() AND datname = current_database()"
            " AND query LIKE %s",
            ('%FROM "events" WHERE%',),
        )
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def test_a_read_after_the_servers_end_of_its_connections_goes_on(
    db: Database, spark: Any
) -> None:
    """Between two reads, PostgreSQL ends the connections the Python workers read with
    (pg_terminate_backend): the next read gets every row, with no worker crash (the
    ADBC driver 1.8 aborts the process when a query is sent on a connection the server
    closed: a kept one is used again only when its socket shows it whole)."""
    await create_events(db)
    async with writers(db, "w1", "w2", all_writers=["w1", "w2"]) as gens:
        written = await write(gens["w1"], "a", 500) + await write(gens["w2"], "b", 500)
        options = {"maxIdsPerPartition": "100"}  # tasks on both workers
        frame = reader(spark, db.dsn, **options).load()
        first = await asyncio.to_thread(_collect_ids, spark, frame, "before")
        assert sorted(first) == sorted(written)
        # What a restart does to the connections the workers keep
        assert await _terminate_readers(db) >= 1, "no kept connection to end"
        written += await write(gens["w1"], "c", 10)
        frame = reader(spark, db.dsn, **options).load()
        again = await asyncio.to_thread(_collect_ids, spark, frame, "after-terminate")
        assert sorted(again) == sorted(written)
        # Not by a retry: a task whose worker crashed would be run again (local[2,4]).
        assert await asyncio.to_thread(_failed_tasks, spark, "after-terminate") == 0


async def test_a_read_whose_connection_drops_midway_fails_its_task_and_spark_tries_again(
    db: Database, spark: Any
) -> None:
    """The connection a Python worker reads rows on is reset in the middle of the read
    (a failover, a proxy restart): the task fails, Spark runs it again (plait's local
    sessions retry tasks as a cluster does), and the read returns every row once. A
    worker crash, or a local session without retries, fails this test. (A connection
    that goes silent instead fails the same way once libpq's keepalives give up on it:
    `tests/test_partition.py` shows those settings end a silent connection.)"""
    await create_events(db)
    async with writers(db, "w1", all_writers=["w1"]) as gens:
        written: list[int] = []
        for _ in range(4):
            written += await write(gens["w1"], "a", 250_000)
    async with proxy_in_front(db.dsn) as (proxy, through):

        def read() -> list[int]:  # in a thread: the proxy needs this event loop
            frame = reader(spark, through, maxIdsPerPartition=250_000).load()
            return _collect_ids(spark, frame, "reset")

        task = asyncio.ensure_future(asyncio.to_thread(read))
        async with db.connection() as conn:

            async def reading() -> bool:
                cur = await conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE state = 'active'"
                    " AND query LIKE %s AND pid <> pg_backend_pid()",
                    ('%FROM "events" WHERE%',),
                )
                row = await cur.fetchone()
                return bool(row and row[0])

            await pace.until(reading, 120, "a Spark task to read events")
        assert proxy.drop_all() >= 1
        got = await pace.wait(task, 180, "the read to end after the reset")
    assert sorted(got) == sorted(written)
    assert await asyncio.to_thread(_failed_tasks, spark, "reset") >= 1  # the reset one


async def test_a_checkpoint_of_another_stream_is_refused_naming_both(
    db: Database, spark: Any, tmp_path: Path
) -> None:
    """The checkpoint of a query on `events2` given to a query on `events` (a copied
    command line): the query fails naming both streams. Before offsets named their
    stream, it ran from events2's offsets and left events' rows below them out."""
    await create_events(db)
    await create_table(db, "events2")
    spec2 = spec_for(["w1"], ("events2",), name="events2")
    gen2 = await MultiWriterIdGenerator.create(db, spec2, "w1", position_flush_interval=0.2)
    try:
        await gen2.insert(
            "INSERT INTO events2 SELECT {id}, 'w1', 'x' || g FROM generate_series(1, 300) g"
            " RETURNING stream_id"
        )
        await gen2.flush_position()
    finally:
        await gen2.close()
    checkpoint = tmp_path / "checkpoint"

    def run(stream: str) -> list[int]:
        query = (
            plait.spark.stream(spark, db.dsn, stream)
            .writeStream.format("parquet")
            .option("path", str(tmp_path / stream))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        return [p.numInputRows for p in query.recentProgress]

    assert sum(await asyncio.to_thread(run, "events2")) == 300
    async with writers(db, "w1", all_writers=["w1"]) as gens:
        await write(gens["w1"], "a", 400)  # past events2's offsets: no head check fires
    with pytest.raises(Exception, match="it is an offset of stream 'events2'") as caught:
        await asyncio.to_thread(run, "events")
    assert "not of stream 'events' (uid " in str(caught.value)


def _scanned_rows(frame: Any) -> int:
    """The rows the plait scan handed to Spark in `frame`'s last run (the BatchScan's
    numOutputRows): with a filter pushed, only the rows the SQL returned."""
    counts: list[int] = []

    def walk(node: Any) -> None:
        metrics = node.metrics()
        if node.nodeName().startswith("BatchScan") and metrics.contains("numOutputRows"):
            counts.append(int(metrics.apply("numOutputRows").value()))
        children = node.children()
        for i in range(children.length()):
            walk(children.apply(i))
        if node.nodeName().startswith("AdaptiveSparkPlan"):
            walk(node.executedPlan())

    walk(frame._jdf.queryExecution().executedPlan())
    assert counts, f"no BatchScan in {frame._jdf.queryExecution().executedPlan().toString()}"
    return sum(counts)


# Filters Spark hands the source, all of which PostgreSQL applies exactly (pushed), and
# some it cannot push (an OR, a function, a timestamp), which Spark applies after.
PUSHED = (
    "stream_id > 10 AND stream_id <= 30",
    "stream_id = 2",
    "instance_name = 'w2'",
    "instance_name IN ('w1', 'nobody')",
    "NOT (instance_name = 'w1')",
    "payload IS NULL",
    "payload LIKE 'a1%'",
    "payload LIKE '%7'",
    "payload LIKE '%é%'",
    "payload IN ('b2', 'a11', NULL)",
    "payload <=> 'a4'",
    "amount >= 5.00 AND amount < 9",
    "amount IS NOT NULL AND NOT (amount > 3)",
    """extra = '{"k": 3}'""",
)
NOT_PUSHED = (
    "stream_id = 3 OR payload = 'b2'",
    "upper(payload) = 'A1'",
    "at < timestamp '2999-01-01 00:00:00' AND payload > 'a5'",
    "payload > 'a5'",
)


async def test_filters_of_a_batch_read_are_applied_in_the_database_exactly_as_spark_would(
    db: Database, spark: Any
) -> None:
    """`where stream_id = 2` reads one row from PostgreSQL, not the whole stream: each
    pushable filter keeps exactly the rows Spark's own evaluation keeps (NULLs, text
    forms, decimals), and the scan hands Spark only those; the others still hold."""
    await create_events(db)
    varied = (
        "INSERT INTO events (stream_id, instance_name, payload, amount, extra)"
        " SELECT {id}, %s, CASE WHEN g %% 5 = 0 THEN NULL WHEN g %% 6 = 0 THEN %s || 'é' || g"
        " ELSE %s || g END, CASE WHEN g %% 7 = 0 THEN NULL ELSE g * 1.25 END,"
        " jsonb_build_object('k', g %% 4) FROM generate_series(1, %s) g RETURNING stream_id"
    )
    async with writers(db, "w1", "w2", all_writers=["w1", "w2"]) as gens:
        for name, prefix, count in (("w1", "a", 25), ("w2", "b", 15), ("w1", "a", 12)):
            gen = gens[name]
            await gen.insert(varied, (name, prefix, prefix, count))
            await gen.flush_position()

    def check() -> None:
        everything = reader(spark, db.dsn).load()
        rows = everything.collect()
        assert len(rows) == 52
        oracle = spark.createDataFrame(rows, everything.schema)  # no source: Spark filters
        for where in PUSHED + NOT_PUSHED:
            frame = reader(spark, db.dsn).load().where(where)
            got = sorted(row.stream_id for row in frame.collect())
            expected = sorted(row.stream_id for row in oracle.where(where).collect())
            assert got == expected, where
            assert expected, f"{where} selects nothing: it tests nothing"
            scanned = _scanned_rows(frame)
            if where in PUSHED:
                assert scanned == len(expected), f"{where}: {scanned} rows read"
            else:  # Spark may still push a part (upper(payload) = .. implies IS NOT NULL)
                assert len(expected) < scanned <= len(rows), f"{where}: {scanned} rows read"
        # With pushdown off (a session's choice, or Spark's default where the session's
        # settings do not reach), Spark filters everything itself: the same rows.
        spark.conf.set(plait.spark.PUSHDOWN, "false")
        try:
            frame = reader(spark, db.dsn).load().where("stream_id = 2")
            assert [row.stream_id for row in frame.collect()] == [2]
            assert _scanned_rows(frame) == len(rows)
        finally:
            spark.conf.set(plait.spark.PUSHDOWN, "true")

    await asyncio.to_thread(check)


async def test_a_trigger_waits_for_min_rows_per_trigger_at_most_max_trigger_delay(
    db: Database, spark: Any
) -> None:
    """minRowsPerTrigger, by the Kafka source's rules for minOffsetsPerTrigger: the
    query's first trigger reads what there is; later ones read nothing while fewer rows
    are pending, then all of them at once when there are enough, or once
    maxTriggerDelay has passed since the last batch."""
    await create_events(db)

    def start(name: str, **options: Any) -> Any:
        frame = plait.spark.stream(spark, db.dsn, "events", **options)
        return frame.writeStream.format("memory").queryName(name).start()

    def count(name: str) -> int:
        return int(spark.table(name).count())

    def batches(query: Any) -> list[tuple[int, str]]:
        progress = query.recentProgress
        return [(p["numInputRows"], p["timestamp"]) for p in progress if p["numInputRows"]]

    async with writers(db, "w1", "w2", all_writers=["w1", "w2"]) as gens:
        await write(gens["w1"], "a", 30)
        spark.conf.set(EVERY_TRIGGER_REPORTS, "0")  # else one trigger without rows in 10 s
        query = await asyncio.to_thread(start, "waits", minRowsPerTrigger=50, maxTriggerDelay="1h")
        spark.conf.unset(EVERY_TRIGGER_REPORTS)  # read as the query started
        try:
            await asyncio.to_thread(query.processAllAvailable)
            assert await asyncio.to_thread(count, "waits") == 30  # the first trigger reads
            await write(gens["w2"], "b", 10)
            await asyncio.to_thread(query.processAllAvailable)
            assert await asyncio.to_thread(count, "waits") == 30  # 10 < 50: no batch yet
            # The progress of a trigger that read nothing says what waits: w2's 10 rows.
            await until(
                lambda: _rows_behind(query.lastProgress)[0].get("w2") == 10,
                "a progress showing w2's 10 rows waiting",
            )
            assert _rows_behind(query.lastProgress) == ({"w1": 0, "w2": 10}, False)
            await write(gens["w1"], "c", 45)
            await asyncio.to_thread(query.processAllAvailable)
            assert await asyncio.to_thread(count, "waits") == 85
            assert [rows for rows, _ in batches(query)] == [30, 55]  # the 55 at once
        finally:
            await asyncio.to_thread(query.stop)

        query = await asyncio.to_thread(
            start, "delayed", minRowsPerTrigger=1000, maxTriggerDelay="2s"
        )
        try:
            await until(lambda: count("delayed") == 85, "the first batch", within=120)
            await write(gens["w2"], "d", 5)
            await until(lambda: count("delayed") == 90, "the delayed batch of 5 rows", within=120)
            (first, at), (late, later) = batches(query)
            assert (first, late) == (85, 5)
            # Not before the delay (a lower bound: a busy machine only makes it later).
            # Spark stamps a trigger as it begins; the source times the delay from when it
            # planned the last batch, a moment into that trigger, and looks again a moment
            # into each later one: the stamps' gap may fall short of the delay by the
            # difference of those moments (CI saw 1.994 s), never by a whole trigger.
            gap = datetime.datetime.fromisoformat(later) - datetime.datetime.fromisoformat(at)
            assert gap.total_seconds() >= 2.0 - _PLANNING_SLACK
        finally:
            await asyncio.to_thread(query.stop)


EVERY_TRIGGER_REPORTS = "spark.sql.streaming.noDataProgressEventInterval"
# How far the gap between two triggers' stamps may fall short of the gap between the
# moments their source looked at the clock (each a moment into its trigger): the lower
# bounds on when a trigger read leave this much, far less than the delays they check.
_PLANNING_SLACK = 0.25


def _rows_behind(progress: Any) -> tuple[dict[str, int], bool]:
    """A trigger's `rowsBehind` per writer, and whether it was counted only up to its cap,
    from the plait source's `latestOffset` in the query's progress."""
    latest = json.loads(progress["sources"][0]["latestOffset"])
    return latest["rowsBehind"], latest.get("rowsBehindAtLeast", False)


async def test_the_progress_of_a_query_says_how_many_rows_each_writer_has_behind(
    db: Database, spark: Any
) -> None:
    """maxRowsPerTrigger cuts each batch short: each trigger's progress shows the rows it
    left per writer (as the Kafka source shows offsets behind), down to none; past ten
    batches' worth, it says "at least"."""
    await create_events(db)
    async with writers(db, "w1", "w2", all_writers=["w1", "w2"]) as gens:
        await write(gens["w1"], "a", 150)
        await write(gens["w2"], "b", 100)

    def run(name: str, max_rows: int) -> list[Any]:
        frame = plait.spark.stream(spark, db.dsn, "events", maxRowsPerTrigger=max_rows)
        writer = frame.writeStream.format("memory").queryName(name)
        query = writer.trigger(availableNow=True).start()
        query.awaitTermination()
        return [p for p in query.recentProgress if p["numInputRows"]]

    progress = await asyncio.to_thread(run, "behind", 100)
    assert [p["numInputRows"] for p in progress] == [100, 100, 50]
    behind = [_rows_behind(p) for p in progress]
    assert [sum(counts.values()) for counts, _ in behind] == [150, 50, 0]
    assert behind[-1] == ({"w1": 0, "w2": 0}, False)
    assert not any(capped for _, capped in behind)
    # 10 batches of 5 rows: 50 index entries shared by the two writers, 25 each.
    progress = await asyncio.to_thread(run, "far_behind", 5)
    assert _rows_behind(progress[0]) == ({"w1": 25, "w2": 25}, True)


async def test_metadata_columns_name_the_stream_and_when_each_row_committed(
    restartable_pg: Any, spark: Any
) -> None:
    """metadataColumns=stream,commitTimestamp: `_stream` and `_commit_timestamp` (from
    PostgreSQL's record of commits, on a server of this test's own with
    track_commit_timestamp turned on); without that setting, one clear error."""
    pg = restartable_pg
    db = await Database.connect(pg.dsn, max_size=4)
    try:
        await db.migrate()
        await create_events(db)
        async with writers(db, "w1", all_writers=["w1"]) as gens:
            await write(gens["w1"], "a", 3)
        options = {"metadataColumns": "stream, commitTimestamp"}
        with pytest.raises(ConfigError, match="set track_commit_timestamp = on"):
            await asyncio.to_thread(plait.spark.batch, spark, pg.dsn, "events", **options)
        async with await psycopg.AsyncConnection.connect(pg.dsn, autocommit=True) as conn:
            await conn.execute("ALTER SYSTEM SET track_commit_timestamp = on")
        await db.close()
        await asyncio.to_thread(pg.restart)
        db = await Database.connect(pg.dsn, max_size=4)

        async def clock() -> float:
            async with db.connection() as conn:
                row = await (await conn.execute("SELECT clock_timestamp()")).fetchone()
            assert row is not None
            return float(row[0].timestamp())

        before = await clock()
        async with writers(db, "w1", all_writers=["w1"]) as gens:
            await write(gens["w1"], "b", 4)
        after = await clock()
        frame = reader(spark, pg.dsn, **options).load()
        rows = await asyncio.to_thread(frame.collect)
    finally:
        await db.close()
    fields = {f.name: f.dataType.simpleString() for f in frame.schema.fields}
    assert (fields["_stream"], fields["_commit_timestamp"]) == ("string", "timestamp")
    assert {row._stream for row in rows} == {"events"}
    stamped = sorted(row._commit_timestamp.timestamp() for row in rows if row._commit_timestamp)
    assert len(rows) == 7
    assert len(stamped) == 4  # committed before the setting: none recorded
    assert before <= stamped[0] <= stamped[-1] <= after
