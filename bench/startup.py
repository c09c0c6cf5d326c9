"""Start-up: time to create a writer's `MultiWriterIdGenerator`, empty vs 10 M rows.

Two streams in one schema:
- `empty`: table `events_empty`, no rows, no position rows (a brand-new stream);
- `events`: table `events` with `--rows` rows (default 10 M) of 4 writers (IDs 2..N+1,
  round robin), built once per run with INSERT ... SELECT generate_series, indexed on
  (instance_name, stream_id), then VACUUM ANALYZE (a running system's autovacuum would
  have done that); `stream_positions` rows as a running system leaves them: each writer
  recorded a little behind its last write, so the last `LAG` rows lie above the lowest
  recorded position and start-up has to read them.

Before every measurement the position rows are put back as they were, so every
repetition starts the same system. Each measurement opens a fresh `Database` (a process
start would) and times, separately, opening it and the thing measured:
- `plait_empty`, `plait_10m`: `MultiWriterIdGenerator.create(db, spec, "w1")`;
- `plait_10m_no_positions`: the same with no `stream_positions` rows (plait's fallback:
  MAX per writer through the index);
- `naive_empty`, `naive_10m`: the simplest comparable thing, `SELECT last_value FROM
  <seq>` plus `SELECT MAX(stream_id) FROM <table>` (with only an (instance_name,
  stream_id) index, that MAX is a parallel sequential scan).
Variants alternate in rotating order; figures are medians. The page cache is warm (the
data was just written), as on a restart of a running system.

Run: python bench/startup.py [--quick] [--dsn DSN] [--rows N]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from psycopg import AsyncConnection

from common import (
    add_common_args,
    bench_schema,
    count_round_trips,
    emit,
    log,
    median,
    parse,
    rnd,
    rotated,
    round_trip_delta,
    round_trip_snapshot,
    run,
    server,
    server_info,
)
from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec
from plait.storage.stream_rows import StreamRows
from plait.storage.stream_store import StreamStore
from plait.storage.writer_rows import WriterRows

TARGET = 1.2
WRITERS = ["w1", "w2", "w3", "w4"]
LAG = 600  # rows above the lowest recorded position
DDL = "CREATE TABLE {t} (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL, payload TEXT)"
VARIANTS = ("plait_empty", "plait_10m", "plait_10m_no_positions", "naive_empty", "naive_10m")


def spec(name: str, table: str) -> StreamSpec:
    return StreamSpec(
        name=name,
        sequence=f"{name}_seq",
        tables=[TableSpec(table, id_column="stream_id", instance_column="instance_name")],
        writers=WRITERS,
    )


SPECS = {"empty": spec("empty", "events_empty"), "events": spec("events", "events")}


async def build(dsn: str, rows: int) -> dict[str, int]:
    """Create both tables and the sequences, fill `events`; return the positions."""
    db = await Database.connect(dsn)
    try:
        await db.migrate()
    finally:
        await db.close()
    top = rows + 1
    async with await AsyncConnection.connect(dsn, autocommit=True) as conn:
        for table in ("events_empty", "events"):
            await conn.execute(DDL.format(t=table))
        await conn.execute("CREATE INDEX ON events_empty (instance_name, stream_id)")
        # Like plait's own sequences: ID 1 taken, the first real ID is 2.
        for name in SPECS:
            await conn.execute(f"CREATE SEQUENCE {name}_seq")
            await conn.execute(f"SELECT nextval('{name}_seq')")
        started = time.perf_counter()
        log(f"generating {rows:,} rows")
        await conn.execute(
            "INSERT INTO events (stream_id, instance_name, payload)"
            " SELECT g, 'w' || ((g - 2) %% 4 + 1), 'payload-' || g FROM generate_series(2, %s) g",
            (top,),
        )
        log("indexing")
        await conn.execute("CREATE INDEX ON events (instance_name, stream_id)")
        log("vacuum analyze")
        await conn.execute("VACUUM ANALYZE events")
        await conn.execute("SELECT setval('events_seq', %s)", (top,))
        log(f"generated in {time.perf_counter() - started:.1f} s")
    # Writer k (IDs with (id - 2) % 4 == k - 1) recorded its last own ID at or below
    # top - LAG * k / 4: the last LAG rows lie above the lowest recorded position.
    positions = {}
    for k, writer in enumerate(WRITERS, start=1):
        limit = top - LAG * k // len(WRITERS)
        positions[writer] = limit - ((limit - 2 - (k - 1)) % len(WRITERS))
    return positions


async def reset_positions(dsn: str, positions: dict[str, int]) -> None:
    async with await AsyncConnection.connect(dsn, autocommit=True) as conn, conn.transaction():
        await conn.execute("DELETE FROM stream_positions")
        for writer, position in positions.items():
            await conn.execute(
                "INSERT INTO stream_positions (stream_name, instance_name, stream_id)"
                " VALUES ('events', %s, %s)",
                (writer, position),
            )


# Seconds spent in each storage step of the last `create` (see `time_steps`).
STEP_TIMES: dict[str, float] = {}
STEPS: tuple[tuple[type, str], ...] = (
    (StreamStore, "check_tables"),
    (StreamStore, "ensure_sequence"),
    (StreamStore, "survey"),
    (StreamStore, "check_sequence"),
    (StreamRows, "ids_above"),
    (WriterRows, "register"),
    (StreamStore, "upsert_position"),
)


def time_steps() -> None:
    """Wrap the storage steps of a start (in this process only) to time each one."""

    def wrap(name: str, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def timed_step(self: object, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await method(self, *args, **kwargs)
            finally:
                STEP_TIMES[name] = STEP_TIMES.get(name, 0.0) + time.perf_counter() - start

        return timed_step

    for owner, name in STEPS:
        setattr(owner, name, wrap(name, getattr(owner, name)))


async def plait_start(db: Database, stream: str) -> dict[str, Any]:
    before = round_trip_snapshot()
    STEP_TIMES.clear()
    gen = await MultiWriterIdGenerator.create(db, SPECS[stream], "w1")
    trips = round_trip_delta(before, round_trip_snapshot())
    info = {
        "steps": dict(STEP_TIMES),
        "round_trips": sum(trips.values()),
        "persisted_upto": gen.get_persisted_upto_position(),
        "positions": gen.get_positions(),
    }
    await gen.close()
    return info


async def naive_start(db: Database, table: str, sequence: str) -> dict[str, Any]:
    async with db.connection() as conn:
        head = await (await conn.execute(f"SELECT last_value FROM {sequence}")).fetchone()
        top = await (await conn.execute(f"SELECT MAX(stream_id) FROM {table}")).fetchone()
    return {"round_trips": 2, "last_value": head and head[0], "max": top and top[0]}


async def measure(
    dsn: str, variant: str, positions: dict[str, int]
) -> tuple[float, float, dict[str, Any]]:
    """(seconds to open the Database, seconds for the variant, details)."""
    await reset_positions(dsn, {} if variant.endswith("no_positions") else positions)
    steps: dict[str, Callable[[Database], Awaitable[dict[str, Any]]]] = {
        "plait_empty": lambda db: plait_start(db, "empty"),
        "plait_10m": lambda db: plait_start(db, "events"),
        "plait_10m_no_positions": lambda db: plait_start(db, "events"),
        "naive_empty": lambda db: naive_start(db, "events_empty", "empty_seq"),
        "naive_10m": lambda db: naive_start(db, "events", "events_seq"),
    }
    t0 = time.perf_counter()
    db = await Database.connect(dsn)
    t1 = time.perf_counter()
    try:
        info = await steps[variant](db)
        t2 = time.perf_counter()
    finally:
        await db.close()
    return t1 - t0, t2 - t1, info


async def main(args: argparse.Namespace) -> None:
    rows = args.rows or (1_000_000 if args.quick else 10_000_000)
    reps = args.reps or 15
    count_round_trips()
    time_steps()
    started = time.perf_counter()
    async with server(args.dsn) as server_dsn:
        log(f"server: {await server_info(server_dsn)}")
        async with bench_schema(server_dsn, "startup") as dsn:
            positions = await build(dsn, rows)
            log(f"recorded positions: {positions} (sequence head {rows + 1})")
            for variant in VARIANTS:  # warm-up: creates nothing new, warms caches
                await measure(dsn, variant, positions)
            connect: dict[str, list[float]] = {v: [] for v in VARIANTS}
            work: dict[str, list[float]] = {v: [] for v in VARIANTS}
            details: dict[str, dict[str, Any]] = {}
            steps: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
            for rep in range(reps):
                for variant in rotated(VARIANTS, rep):
                    opened, took, info = await measure(dsn, variant, positions)
                    connect[variant].append(opened)
                    work[variant].append(took)
                    details[variant] = info
                    for step, seconds in info.get("steps", {}).items():
                        steps[variant].setdefault(step, []).append(seconds)
                log(
                    f"rep {rep + 1}/{reps}: "
                    + ", ".join(f"{v}={work[v][-1] * 1000:.1f}ms" for v in VARIANTS)
                )
            report(rows, reps, connect, work, details, steps)
    log(f"done in {time.perf_counter() - started:.0f} s")


def report(
    rows: int,
    reps: int,
    connect: dict[str, list[float]],
    work: dict[str, list[float]],
    details: dict[str, dict[str, Any]],
    steps: dict[str, dict[str, list[float]]],
) -> None:
    def ms(values: list[float]) -> float:
        return rnd(median(values) * 1000, 2)

    def step_ms(variant: str) -> dict[str, float]:
        return {step: ms(values) for step, values in steps[variant].items()}

    def samples(values: list[float]) -> list[float]:
        return [rnd(v * 1000, 2) for v in values]

    empty, big = median(work["plait_empty"]), median(work["plait_10m"])
    connect_all = [v for vs in connect.values() for v in vs]

    def with_connect(variant: str) -> list[float]:
        """Per repetition: opening the Database plus the measured step."""
        return [c + w for c, w in zip(connect[variant], work[variant], strict=True)]

    big_total = median(with_connect("plait_10m"))
    empty_total = median(with_connect("plait_empty"))
    emit(
        {
            "bench": "startup_empty",
            "rows": 0,
            "plait_create_ms": ms(work["plait_empty"]),
            "naive_ms": ms(work["naive_empty"]),
            "ratio_vs_naive": rnd(empty / median(work["naive_empty"]), 2),
            "db_connect_ms": ms(connect_all),
            "plait_round_trips": details["plait_empty"]["round_trips"],
            "plait_steps_ms": step_ms("plait_empty"),
            "reps": reps,
            "plait_samples_ms": samples(work["plait_empty"]),
            "naive_samples_ms": samples(work["naive_empty"]),
        }
    )
    ratio = big / empty
    emit(
        {
            "bench": "startup_10m",
            "rows": rows,
            "rows_above_lowest_position": LAG,
            "plait_create_ms": ms(work["plait_10m"]),
            "plait_empty_create_ms": ms(work["plait_empty"]),
            "ratio": rnd(ratio, 3),
            "target": TARGET,
            "meets_target": ratio <= TARGET,
            "connect_plus_create_ms": ms(with_connect("plait_10m")),
            "empty_connect_plus_create_ms": ms(with_connect("plait_empty")),
            "ratio_with_connect": rnd(big_total / empty_total, 3),
            "naive_ms": ms(work["naive_10m"]),
            "ratio_vs_naive": rnd(big / median(work["naive_10m"]), 3),
            "db_connect_ms": ms(connect_all),
            "plait_round_trips": details["plait_10m"]["round_trips"],
            "plait_steps_ms": step_ms("plait_10m"),
            "persisted_upto": details["plait_10m"]["persisted_upto"],
            "reps": reps,
            "plait_samples_ms": samples(work["plait_10m"]),
            "plait_empty_samples_ms": samples(work["plait_empty"]),
            "naive_samples_ms": samples(work["naive_10m"]),
        }
    )
    fallback = median(work["plait_10m_no_positions"])
    emit(
        {
            "bench": "startup_10m_no_positions",
            "rows": rows,
            "plait_create_ms": ms(work["plait_10m_no_positions"]),
            "plait_empty_create_ms": ms(work["plait_empty"]),
            "ratio": rnd(fallback / empty, 3),
            "target": TARGET,
            "meets_target": fallback / empty <= TARGET,
            "naive_ms": ms(work["naive_10m"]),
            "ratio_vs_naive": rnd(fallback / median(work["naive_10m"]), 3),
            "plait_round_trips": details["plait_10m_no_positions"]["round_trips"],
            "plait_steps_ms": step_ms("plait_10m_no_positions"),
            "reps": reps,
            "plait_samples_ms": samples(work["plait_10m_no_positions"]),
        }
    )


# --smoke: the smallest sizes that still go through every step.
SMOKE = ["--rows", "2000", "--reps", "1"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--rows", type=int, default=0, help="rows in the big table")
    parser.add_argument("--reps", type=int, default=0, help="repetitions per variant")
    return parse(parser, SMOKE, argv)


if __name__ == "__main__":
    run(main, parse_args(sys.argv[1:]))
