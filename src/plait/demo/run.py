"""`plait demo`: the chat service as separate processes, a load of simulated users, a
live dashboard, then the Spark export of `events` to Parquet, each step checked.

Processes (each `plait serve --app plait.demo.roles:<role>`): `main` (the TCP hub, or a
Redis client with `--redis`), two event writers, a sync worker and the background
worker. The database is the given DSN or plait's embedded server; the demo works in a
schema of its own, `plait_demo`, dropped and made again at every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from plait.demo import SCHEMA, schema
from plait.demo.load import Load, Tally
from plait.demo.processes import ROLES, Processes
from plait.errors import ConfigError
from plait.ops import status
from plait.storage import stream_records
from plait.storage.database import Database
from plait.storage.embedded import dsn_or_embedded
from plait.storage.search_path import in_schema


def dashboard(
    found: list[status.StreamStatus],
    speeds: dict[tuple[str, str], float],
    tally: Tally,
    left: float,
) -> Group:
    """`speeds`: rows a second per (stream, writer)."""
    table = Table(title="plait demo: streams and writers", title_justify="left")
    columns = ("stream", "writer", "position", "persisted up to", "gap", "rows/s", "oldest pending")
    for column in columns:
        table.add_column(column, justify="left" if column in ("stream", "writer") else "right")
    for stream in found:
        for w in stream.writers:
            speed = speeds.get((stream.name, w.writer))
            pending = w.pending_age
            table.add_row(
                stream.name, w.writer, str(w.position if w.position is not None else "-"),
                str(stream.persisted_up_to if stream.persisted_up_to is not None else "-"),
                str(stream.gap), "" if speed is None else f"{speed:.0f}",
                "?" if pending is None else ("-" if pending == 0 else f"{pending * 1000:.0f} ms"),
            )  # fmt: skip
    p50, p99 = tally.percentile(0.5), tally.percentile(0.99)
    latency = (
        "-" if p50 is None or p99 is None else f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms"
    )
    writes = ", ".join(f"{n} {kind}" for kind, n in sorted(tally.writes.items()))
    got = sum(1 for i in tally.sent if i in tally.received)
    return Group(
        table,
        Text(f"writes: {writes or '-'}; errors: {tally.errors}"),
        Text(f"sync latency (send to a long-polling client): {latency}"),
        Text(f"messages received by the syncing client: {got} of {len(tally.sent)}"),
        Text(f"{max(left, 0):.0f} s left" if left > 0 else "load stopped: catching up", end="\n"),
    )


def _look(
    conn: psycopg.Connection[Any], processes: Processes, before: list[status.StreamStatus] | None
) -> tuple[list[status.StreamStatus], dict[tuple[str, str], int]]:
    """The streams as `plait status` sees them, with the processes' pending ages, and the
    rows each writer persisted since `before`."""
    pending, _ = status.scrape(processes.api_urls, timeout=1.0)
    streams = stream_records.read(conn)
    found = [status.assess(s, pending=pending) for s in streams]
    if before is None:
        return found, {}
    return found, stream_records.rows_written(conn, streams, status.positions(before))


def reader_coverage(dsn: str, positions: dict[str, dict[str, int]]) -> tuple[int, dict[str, int]]:
    """Rows of the `events` stream, and how many of them each process has seen (those
    at or below its position for their writer)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        total = 0
        covered = dict.fromkeys(positions, 0)
        for table in ("events", "room_state"):
            name = sql.Identifier(table)
            for writer, count, top in conn.execute(
                sql.SQL("SELECT instance_name, count(*), max(stream_id) FROM {} GROUP BY 1").format(
                    name
                )
            ).fetchall():
                total += count
                for reader, seen in positions.items():
                    if seen.get(writer, 0) >= top:
                        covered[reader] += count
                    else:
                        (row,) = conn.execute(
                            sql.SQL(
                                "SELECT count(*) FROM {} WHERE instance_name = %s"
                                " AND stream_id <= %s"
                            ).format(name),
                            (writer, seen.get(writer, 0)),
                        ).fetchall()
                        covered[reader] += row[0]
    return total, covered


async def positions_of(processes: Processes) -> dict[str, dict[str, int]]:
    """Each process's view of the `events` writers' positions, from its /metrics."""
    out: dict[str, dict[str, int]] = {}
    async with aiohttp.ClientSession() as session:
        for name in ROLES:
            async with session.get(processes.metrics_url(name)) as response:
                text = await response.text()
            out[name] = {
                sample.labels["writer"]: int(sample.value)
                for family in text_string_to_metric_families(text)
                if family.name == "plait_stream_position"
                for sample in family.samples
                if sample.labels.get("stream") == "events"
            }
    return out


_MARK = "made by plait demo, which drops and makes it again at every run"


async def _prepare(server_dsn: str, schema_name: str) -> str:
    """The demo's schema, made anew. One that exists is dropped only when the demo made
    it (its comment says so; `plait_demo` is the demo's by name): --schema may name
    anything, and the demo must never drop an application's tables."""
    dsn = in_schema(server_dsn, schema_name, "--schema")  # a plain name: safe to quote
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = %s",
            (schema_name,),
        ).fetchone()
        if row is not None and row[0] != _MARK and schema_name != SCHEMA:
            raise ConfigError(
                f"--schema {schema_name!r} exists and plait demo did not make it: the demo "
                "drops its schema at every run, so give it a new name"
            )
        conn.execute(
            f'DROP SCHEMA IF EXISTS "{schema_name}" CASCADE; CREATE SCHEMA "{schema_name}";'
            f"COMMENT ON SCHEMA \"{schema_name}\" IS '{_MARK}'"
        )
    db = await Database.connect(dsn, min_size=1, max_size=1)
    try:
        await db.migrate()
        await db.run_schema(schema.TABLES)
    finally:
        await db.close()
    return dsn


@contextlib.asynccontextmanager
async def _running(dsn: str, redis: str | None, logs: Path) -> AsyncIterator[Processes]:
    processes = Processes(dsn, redis, logs)
    try:
        await processes.start()
        yield processes
    finally:
        await processes.stop()


async def _load(processes: Processes, duration: float, console: Console) -> tuple[Tally, bool, str]:
    tally = Tally()
    load = Load(processes.sync_url, tally)
    stop = asyncio.Event()
    conn: psycopg.Connection[Any] = await asyncio.to_thread(
        lambda: psycopg.connect(processes.dsn, autocommit=True)
    )
    tasks: list[asyncio.Task[None]] = []
    try:
        async with aiohttp.ClientSession() as session:
            await load.setup(session)
            tasks.append(asyncio.create_task(load.observe(session, stop)))
            until = time.monotonic() + duration
            users = [asyncio.create_task(load.user(session, until)) for _ in range(4)]
            tasks += users
            before: list[status.StreamStatus] | None = None
            taken = time.monotonic()
            with Live(console=console, auto_refresh=False, transient=False) as live:
                while True:
                    now = time.monotonic()
                    found, rows = await asyncio.to_thread(_look, conn, processes, before)
                    speeds = {key: n / (now - taken) for key, n in rows.items()}
                    before, taken = found, now
                    live.update(dashboard(found, speeds, tally, until - now), refresh=True)
                    done = all(task.done() for task in users)
                    caught_up = all(i in tally.received for i in tally.sent)
                    if done and (caught_up or now > until + 15):
                        break
                    await asyncio.sleep(0.5)
            console.line()
            stop.set()
            await asyncio.gather(*tasks)
    finally:
        stop.set()
        for task in tasks:  # Ctrl-C: the load ends with the processes
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        conn.close()
    positions = await positions_of(processes)
    total, covered = await asyncio.to_thread(reader_coverage, processes.dsn, positions)
    least = min(covered.values())
    line = f"rows delivered to every reader: {least} of {total}"
    messages_ok = all(tally.received.get(i) == 1 for i in tally.sent) and tally.duplicates == 0
    return tally, least == total and messages_ok and tally.errors == 0, line


def _export(dsn: str, folder: Path) -> tuple[int, int]:
    """The Spark export of `events` (its `events` table) to Parquet, exactly once, and
    the rows on each side."""
    from plait.spark import pipelines
    from plait.spark.session import quiet_session

    spark = quiet_session("plait-demo", master="local[2]")
    try:
        source = pipelines.Source(dsn=dsn, stream="events", table="events")
        path, checkpoint = folder / "events.parquet", folder / "checkpoint"
        query = pipelines.export(
            spark, source, to="parquet", path=str(path), checkpoint=str(checkpoint), once=True
        )
        pipelines.run(query)
        in_parquet = spark.read.parquet(str(path)).count()
    finally:
        spark.stop()
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM events").fetchone()
    return (0 if row is None else int(row[0])), int(in_parquet)


async def demo(
    *,
    duration: float,
    dsn: str | None,
    redis: str | None,
    spark: bool,
    console: Console,
    keep: bool = False,
    schema_name: str = SCHEMA,
) -> bool:
    """Run the whole demo; True when every check held. Its folder (process logs, the
    Parquet export) is removed after a run whose checks all held, unless `keep`."""
    logs = Path(tempfile.mkdtemp(prefix="plait-demo-"))
    ok = False
    try:
        ok = await _demo(duration, dsn, redis, spark, console, logs, schema_name)
    finally:
        if ok and not keep:
            shutil.rmtree(logs, ignore_errors=True)
        else:
            console.print(f"process logs{' and the export' if spark else ''} kept in {logs}")
    where = "" if dsn is None else " --dsn DSN"  # the DSN given to the demo
    console.print("its data stays until the next run; see it with:", soft_wrap=True)
    for command in ("status", "tail events"):
        console.print(f"  plait {command}{where} --schema {schema_name}", soft_wrap=True)
    return ok


async def _demo(
    duration: float,
    dsn: str | None,
    redis: str | None,
    spark: bool,
    console: Console,
    logs: Path,
    schema_name: str,
) -> bool:
    with dsn_or_embedded(dsn) as server_dsn:
        demo_dsn = await _prepare(server_dsn, schema_name)
        console.print(f"database ready (schema {schema_name}); process logs in {logs}")
        async with _running(demo_dsn, redis, logs) as processes:
            console.print(
                f"running {', '.join(ROLES)} over {'Redis' if redis else 'the TCP hub'}; "
                f"sync API at {processes.sync_url}"
            )
            tally, ok, line = await _load(processes, duration, console)
        console.print(Text(line, style="bold green" if ok else "bold red"))
        console.print(
            f"messages received by the syncing client: "
            f"{sum(1 for i in tally.sent if tally.received.get(i) == 1)} of {len(tally.sent)}, "
            f"{tally.duplicates} duplicated, {tally.errors} errors"
        )
        if spark:
            console.print("exporting events to Parquet with Spark (plait source, exactly once)")
            in_pg, in_parquet = await asyncio.to_thread(_export, demo_dsn, logs)
            same = in_pg == in_parquet
            console.print(
                Text(
                    f"rows in PostgreSQL: {in_pg}, rows in Parquet: {in_parquet}",
                    style="bold green" if same else "bold red",
                )
            )
            ok = ok and same
    return ok
