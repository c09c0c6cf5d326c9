"""The Spark pipelines (`plait export`, `plait derive`) exactly once: across kill -9 of
the query process in the middle of a batch, and across replayed batches."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import pace
from plait import ConfigError, Database
from plait.spark import delta as delta_export
from plait.spark import pipelines
from stream_helpers import create_generator

pytestmark = pytest.mark.timeout(300)

INSERT = (
    "INSERT INTO events (stream_id, instance_name, payload, at)"
    " SELECT {id}, %s, %s || (g %% 7), now() - g * interval '10 minutes'"
    " FROM generate_series(1, %s) g RETURNING stream_id"
)


async def prepare(db: Database, per_writer: int) -> list[int]:
    """`per_writer` rows from each of w1 and w2 (in statements of 500)."""
    async with db.connection() as conn:
        await conn.execute(
            "CREATE TABLE events (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
            " payload TEXT, at TIMESTAMPTZ NOT NULL); CREATE INDEX ON events"
            " (instance_name, stream_id)"
        )
    ids: list[int] = []
    for name in ("w1", "w2"):
        gen = await create_generator(db, ["w1", "w2"], name)
        for _ in range(per_writer // 500):
            ids += await gen.insert(INSERT, (name, f"k{name}-", 500))
        await gen.close()  # stores its final position
    return ids


def cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "plait.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # kill -9 takes Spark's JVM down with it
    )


@pytest.mark.slow
async def test_export_is_exactly_once_across_kill_9_in_the_middle_of_a_batch(
    db: Database, spark: Any, tmp_path: Path
) -> None:
    written = await prepare(db, 3000)
    args = [
        "export",
        "--dsn", db.dsn,
        "--stream", "events",
        "--checkpoint", str(tmp_path / "checkpoint"),
        "--path", str(tmp_path / "out"),
        "--partition-by-date", "at",
        "--max-rows-per-trigger", "250",
    ]  # fmt: skip
    first = cli(*args)
    assert first.stderr is not None
    batches = 0
    for line in first.stderr:
        if line.startswith("batch "):
            batches += 1
            if batches == 3:  # the next batch is under way
                break
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert batches == 3
    second = cli(*args, "--once")
    _, errors = await asyncio.to_thread(pace.communicate, second, 240)
    assert second.returncode == 0, errors
    lines = [line for line in errors.splitlines() if line.startswith("batch ")]
    assert lines  # the rest, in batches of at most 250 rows
    assert all(int(line.split()[2]) <= 250 for line in lines)
    rows = await asyncio.to_thread(
        lambda: spark.read.parquet(str(tmp_path / "out")).select("stream_id", "date").collect()
    )
    ids = [row.stream_id for row in rows]
    assert len(ids) == len(set(ids)) == len(written)  # every committed row once
    assert sorted(ids) == sorted(written)
    assert len({row.date for row in rows}) >= 2  # partitioned by the date of `at`


async def test_a_replayed_batch_changes_no_derived_table_and_no_delta_table(
    db: Database, spark: Any, tmp_path: Path
) -> None:
    await prepare(db, 1000)
    source = pipelines.Source(db.dsn, "events", max_rows=300)
    latest = pipelines.Derived(db.dsn, "latest_payload", key="payload", kind="latest")
    counts = pipelines.Derived(db.dsn, "payload_counts", key="payload", kind="counts")
    for target in (latest, counts):
        query = pipelines.derive(
            spark, source, target, checkpoint=str(tmp_path / target.table), once=True
        )
        await asyncio.to_thread(query.awaitTermination, 120)
    async with db.connection() as conn:
        cur = await conn.execute("SELECT key, stream_id FROM latest_payload ORDER BY key")
        newest = await cur.fetchall()
        cur = await conn.execute("SELECT key, sum(count) FROM payload_counts GROUP BY 1")
        totals: dict[str, Decimal] = dict(await cur.fetchall())  # sum(BIGINT) is NUMERIC
        cur = await conn.execute("SELECT payload, max(stream_id) FROM events GROUP BY 1 ORDER BY 1")
        assert newest == await cur.fetchall()
        cur = await conn.execute("SELECT payload, count(*) FROM events GROUP BY 1")
        assert totals == dict(await cur.fetchall())
        cur = await conn.execute("SELECT job, max(batch_id) FROM plait_spark_batches GROUP BY 1")
        markers: dict[str, int] = dict(await cur.fetchall())
    # 2 000 rows in batches of at most 300: batches 0 to 6.
    assert markers == {"derive:latest_payload": 6, "derive:payload_counts": 6}

    # Spark replays batch 2 after a crash: its marker is there, nothing changes.
    frame = spark.read.format("plait").option("dsn", db.dsn).option("stream", "events").load()
    rows = await asyncio.to_thread(counts.batch_rows, frame)
    assert counts.apply(rows, 2) is False
    assert counts.apply([], 7) is True  # a new batch is applied
    async with db.connection() as conn:
        cur = await conn.execute("SELECT key, sum(count) FROM payload_counts GROUP BY 1")
        assert dict(await cur.fetchall()) == totals

    # The Delta export: a batch id already committed writes nothing the second time.
    # Keyed by the query id in the checkpoint's metadata (outside a running query).
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "metadata").write_text('{"id":"query-1"}\n')
    delta = delta_export.DeltaBatches(str(tmp_path / "delta"), str(checkpoint), [])
    batch = await asyncio.to_thread(lambda: frame.limit(10))
    await asyncio.to_thread(delta, batch, 0)
    await asyncio.to_thread(delta, batch, 0)  # replayed
    await asyncio.to_thread(delta, batch, 1)
    from deltalake import DeltaTable

    table = DeltaTable(str(tmp_path / "delta"))
    assert table.to_pyarrow_table().num_rows == 20
    assert table.transaction_version("plait-export:query-1") == 1
    ids = collections.Counter(
        table.to_pyarrow_table(columns=["stream_id"])["stream_id"].to_pylist()
    )
    assert set(ids.values()) == {2}  # batches 0 and 1 once each, the replay of 0 not at all


async def test_export_to_delta_resumes_from_its_checkpoint_with_each_row_once(
    db: Database, spark: Any, tmp_path: Path
) -> None:
    written = await prepare(db, 500)
    source = pipelines.Source(db.dsn, "events", max_rows=400)
    delta, checkpoint = str(tmp_path / "delta"), str(tmp_path / "ck")

    def export_once() -> None:
        query = pipelines.export(
            spark,
            source,
            to="delta",
            path=delta,
            checkpoint=checkpoint,
            partition_by="instance_name",
            once=True,
        )
        query.awaitTermination(120)

    await asyncio.to_thread(export_once)
    gen = await create_generator(db, ["w1", "w2"], "w2")
    written += await gen.insert(INSERT, ("w2", "late-", 300))
    await gen.close()
    await asyncio.to_thread(export_once)
    from deltalake import DeltaTable

    table = DeltaTable(delta)
    ids = table.to_pyarrow_table(columns=["stream_id"])["stream_id"].to_pylist()
    assert sorted(ids) == sorted(written)  # 1 300 rows, each once
    assert table.metadata().partition_columns == ["instance_name"]
    query_id = delta_export.checkpoint_query_id(checkpoint)
    assert query_id is not None
    assert table.transaction_version(f"plait-export:{query_id}") == 3  # batches 0-3


async def test_a_delta_batch_replayed_through_a_checkpoint_spelt_otherwise_is_written_once(
    db: Database, spark: Any, tmp_path: Path
) -> None:
    """A crash between the Delta commit of a batch and Spark's own commit of it: on the
    next run Spark replays that batch, and the export skips it, also when the next run
    names the same checkpoint by another path (relative, where the first was absolute).
    Keyed by the path's text, the batch was written twice."""
    written = await prepare(db, 500)
    source = pipelines.Source(db.dsn, "events", max_rows=400)
    checkpoint = tmp_path / "ck"
    delta = str(tmp_path / "delta")

    def export_once(spelt: str) -> None:
        query = pipelines.export(spark, source, to="delta", path=delta, checkpoint=spelt, once=True)
        assert query.awaitTermination(120), "waited 120 s for the export to read all rows"

    await asyncio.to_thread(export_once, str(checkpoint))
    commits = sorted(
        (p for p in (checkpoint / "commits").iterdir() if p.name.isdigit()),
        key=lambda p: int(p.name),
    )
    assert [p.name for p in commits] == ["0", "1", "2"]  # 1 000 rows, at most 400 a batch
    commits[-1].unlink()  # Spark's commit of batch 2 never happened: it replays it
    (checkpoint / "commits" / ".2.crc").unlink(missing_ok=True)
    relative = await asyncio.to_thread(os.path.relpath, checkpoint)  # Spark resolves it here
    assert not relative.startswith("/")
    await asyncio.to_thread(export_once, relative)
    from deltalake import DeltaTable

    ids = DeltaTable(delta).to_pyarrow_table(columns=["stream_id"])["stream_id"].to_pylist()
    assert sorted(ids) == sorted(written)  # batch 2 once, not twice


@pytest.mark.slow
async def test_plait_derive_keeps_counts_per_key_and_hour_across_runs(
    db: Database, tmp_path: Path
) -> None:
    """The command itself, twice on one checkpoint with rows written in between: the
    table holds the counts of every row once."""
    await prepare(db, 500)
    args = [
        "derive",
        "--dsn", db.dsn,
        "--stream", "events",
        "--checkpoint", str(tmp_path / "checkpoint"),
        "--target-table", "counts_by_hour",
        "--key", "payload",
        "--kind", "counts",
        "--time-column", "at",
        "--once",
    ]  # fmt: skip

    async def derive() -> list[str]:
        process = cli(*args)
        _, errors = await asyncio.to_thread(pace.communicate, process, 240)
        assert process.returncode == 0, errors
        return [line for line in errors.splitlines() if line.strip()]

    first = await derive()
    assert first
    assert all(line.startswith("batch ") for line in first)  # nothing else on the console
    gen = await create_generator(db, ["w1", "w2"], "w1")
    await gen.insert(INSERT, ("w1", "kw1-", 100))
    await gen.close()
    await derive()
    async with db.connection() as conn:
        cur = await conn.execute("SELECT key, hour, count FROM counts_by_hour ORDER BY 1, 2")
        got = await cur.fetchall()
        cur = await conn.execute(
            "SELECT payload, date_trunc('hour', at), count(*) FROM events GROUP BY 1, 2"
            " ORDER BY 1, 2"
        )
        assert got == await cur.fetchall()


@pytest.mark.slow
async def test_export_from_the_installed_script_with_no_python_of_its_own_on_the_path(
    db: Database, tmp_path: Path
) -> None:
    """As a user runs it: `venv/bin/plait export` without activating the venv, so the
    `python3` on PATH (Spark's default for its Python workers) is another Python that
    has neither plait nor PySpark. The workers must run in plait's own Python."""
    written = await prepare(db, 500)
    script = Path(sys.executable).parent / "plait"
    assert script.exists(), f"the installed console script {script}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "VIRTUAL_ENV"))}
    env["PATH"] = "/usr/bin:/bin"  # no directory of plait's Python
    args = [
        str(script), "export",
        "--dsn", db.dsn,
        "--stream", "events",
        "--checkpoint", str(tmp_path / "checkpoint"),
        "--path", str(tmp_path / "out"),
        "--once",
    ]  # fmt: skip
    process = await asyncio.to_thread(
        pace.run, args, 240, env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert process.returncode == 0, process.stderr[-3000:]
    import pyarrow.parquet as pq

    ids = pq.read_table(tmp_path / "out", columns=["stream_id"])["stream_id"].to_pylist()
    assert sorted(ids) == sorted(written)
    assert process.stderr.count("batch 0:") == 1, process.stderr  # one line per batch
    # Run again with nothing new: it says so (it printed nothing at all).
    again = await asyncio.to_thread(
        pace.run, args, 240, env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.strip() == (
        "nothing new: the stream has no rows past where the checkpoint ends"
    )


async def test_delta_files_are_written_by_the_tasks_and_partition_values_survive_any_text(
    spark: Any, tmp_path: Path
) -> None:
    """The Delta export's tasks write the files (one per partition value per task) and
    the driver commits them: partition values with '/', '%', '=', spaces, non-ASCII
    text and NULL read back as written, and a replayed batch adds no file."""
    import datetime

    from deltalake import DeltaTable

    parts = ["a/b c", "x%y=z", "é", None, "plain"]
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    (checkpoint / "metadata").write_text('{"id":"query-2"}\n')
    rows = [(i, parts[i % len(parts)], datetime.date(2026, 1, 1 + i % 3)) for i in range(200)]

    def export() -> None:
        frame = spark.createDataFrame(rows, "id long, part string, day date").repartition(4)
        batches = delta_export.DeltaBatches(str(tmp_path / "t"), str(checkpoint), ["part", "day"])
        batches(frame, 0)
        batches(frame, 0)  # replayed: skipped

    await asyncio.to_thread(export)
    table = DeltaTable(str(tmp_path / "t"))
    got = table.to_pyarrow_table()
    assert sorted(zip(*(got[c].to_pylist() for c in ("id", "part", "day")), strict=True)) == rows
    files = table.file_uris()
    assert len(files) <= 4 * len(parts) * 3  # per task and value, not per row
    assert table.version() == 0  # one commit: the replay wrote nothing


def test_a_delta_export_without_a_readable_query_id_stops_rather_than_guess(
    tmp_path: Path,
) -> None:
    """Its batches are keyed by the query id in the checkpoint; one it cannot read (a
    checkpoint on a file system this machine does not see) is an error: keyed by the
    path's text, a new checkpoint at the same path skipped the new query's batches."""
    batches = delta_export.DeltaBatches(str(tmp_path / "t"), str(tmp_path / "nowhere"), [])
    with pytest.raises(ConfigError, match="cannot read its query's id from the checkpoint"):
        batches.app_id()


def test_delta_partition_values_are_written_as_delta_reads_them() -> None:
    import datetime

    zone = datetime.timezone(datetime.timedelta(hours=2))
    moment = datetime.datetime(2026, 1, 2, 3, 4, 5, 600, tzinfo=zone)
    assert delta_export.partition_text(moment) == "2026-01-02 01:04:05.000600"  # UTC
    naive = datetime.datetime(2026, 1, 2, 3, 4, 5)
    assert delta_export.partition_text(naive) == "2026-01-02 03:04:05.000000"
    assert delta_export.partition_text(datetime.date(2026, 1, 2)) == "2026-01-02"
    assert delta_export.partition_text(True) == "true"
    assert delta_export.partition_text(None) is None
