"""Allocation: `get_next` calls/s with many concurrent tasks on one writer.

plait: `--tasks` asyncio tasks (default 100) on one writer each loop on
`async with gen.get_next() as sid: pass`; concurrent calls share `SELECT nextval` round
trips (the allocator's `round_trips` counter gives IDs per round trip), and completions
poke the background position upserts as in real use.
Baseline: the same number of tasks, each looping on its own `SELECT nextval('events_seq')`
through a psycopg_pool `AsyncConnectionPool` of the same size as plait's pool.
Also measured with a single task (`--tasks 1 100` is the default) for context: there no
round trip can be shared.

Variants alternate (A B A B ...), phases start on the same sequence; figures are
medians.

Run: python bench/allocation.py [--quick] [--dsn DSN] [--tasks 1 100] [--pool 10]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import TupleRow
from psycopg_pool import AsyncConnectionPool

from common import (
    EVENTS_DDL,
    add_common_args,
    bench_schema,
    count_round_trips,
    emit,
    log,
    median,
    parse,
    rnd,
    round_trip_delta,
    round_trip_snapshot,
    run,
    server,
    server_info,
)
from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec

VARIANTS = ("plait", "baseline")
SPEC = StreamSpec(
    name="events",
    sequence="events_seq",
    tables=[TableSpec("events", id_column="stream_id", instance_column="instance_name")],
    writers=["w1"],
)


async def run_tasks(
    tasks: int, duration: float, call: Callable[[], Awaitable[None]]
) -> tuple[int, float]:
    """(calls, seconds) of `tasks` tasks looping on `call` for `duration` seconds."""
    done = 0
    deadline = time.perf_counter() + duration

    async def loop() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await call()
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(tasks)))
    return done, time.perf_counter() - start


async def main(args: argparse.Namespace) -> None:
    reps = args.reps or (3 if args.quick else 7)
    phase_s = args.phase or (1.0 if args.quick else 2.5)
    count_round_trips()
    started = time.perf_counter()
    async with server(args.dsn) as server_dsn:
        log(f"server: {await server_info(server_dsn)}")
        async with bench_schema(server_dsn, "allocation") as dsn:
            db = await Database.connect(dsn, min_size=args.pool, max_size=args.pool)
            pool: AsyncConnectionPool[AsyncConnection[TupleRow]] = AsyncConnectionPool(
                dsn,
                min_size=args.pool,
                max_size=args.pool,
                kwargs={"autocommit": True},
                open=False,
                name="baseline",
            )
            await pool.open(wait=True, timeout=30)
            try:
                await db.migrate()
                async with db.connection() as conn:
                    await conn.execute(EVENTS_DDL)
                gen = await MultiWriterIdGenerator.create(db, SPEC, "w1")
                try:
                    for tasks in args.tasks:
                        log(f"{tasks} concurrent task(s)")
                        await run_level(gen, pool, tasks, reps, phase_s, args.pool)
                finally:
                    await gen.close()
            finally:
                await pool.close()
                await db.close()
    log(f"done in {time.perf_counter() - started:.0f} s")


async def run_level(
    gen: MultiWriterIdGenerator,
    pool: AsyncConnectionPool[AsyncConnection[TupleRow]],
    tasks: int,
    reps: int,
    phase_s: float,
    pool_size: int,
) -> None:
    async def plait_call() -> None:
        async with gen.get_next():
            pass

    async def baseline_call() -> None:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT nextval('events_seq')")
            await cur.fetchone()

    calls = {"plait": plait_call, "baseline": baseline_call}
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    writer = gen._position_writer
    plait_calls = plait_trips = plait_upserts = 0
    trips: dict[str, int] = {}
    for variant in VARIANTS:  # warm-up
        await run_tasks(tasks, min(0.3, phase_s), calls[variant])
    for rep in range(reps):
        order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            before_alloc = gen._allocator.round_trips
            before_upserts = writer.upserts if writer is not None else 0
            before_trips = round_trip_snapshot()
            done, elapsed = await run_tasks(tasks, phase_s, calls[variant])
            rates[variant].append(done / elapsed)
            if variant == "plait":
                plait_calls += done
                plait_trips += gen._allocator.round_trips - before_alloc
                plait_upserts += (writer.upserts if writer is not None else 0) - before_upserts
                for kind, n in round_trip_delta(before_trips, round_trip_snapshot()).items():
                    trips[kind] = trips.get(kind, 0) + n
        log(
            f"tasks={tasks} rep {rep + 1}/{reps}: "
            + ", ".join(f"{v}={rates[v][-1]:.0f}/s" for v in VARIANTS)
        )
    plait_rate, base_rate = median(rates["plait"]), median(rates["baseline"])
    figure: dict[str, Any] = {
        "bench": "allocation",
        "tasks": tasks,
        "pool_size": pool_size,
        "plait_calls_per_s": rnd(plait_rate, 1),
        "baseline_calls_per_s": rnd(base_rate, 1),
        "ratio": rnd(plait_rate / base_rate, 3),
        "plait_ids_per_round_trip": rnd(plait_calls / max(plait_trips, 1), 2),
        "baseline_ids_per_round_trip": 1.0,
        "plait_position_upserts_per_call": rnd(plait_upserts / max(plait_calls, 1), 4),
        "plait_round_trips_per_call": {
            k: rnd(v / max(plait_calls, 1), 4) for k, v in sorted(trips.items())
        },
        "reps": reps,
        "phase_s": phase_s,
        "plait_samples": [rnd(r, 1) for r in rates["plait"]],
        "baseline_samples": [rnd(r, 1) for r in rates["baseline"]],
    }
    emit(figure)


# --smoke: the smallest sizes that still go through every step.
SMOKE = ["--tasks", "1", "4", "--reps", "1", "--phase", "0.05"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 100])
    parser.add_argument("--pool", type=int, default=10, help="pool size (both sides)")
    parser.add_argument("--reps", type=int, default=0, help="repetitions per variant")
    parser.add_argument("--phase", type=float, default=0.0, help="seconds per phase")
    return parse(parser, SMOKE, argv)


if __name__ == "__main__":
    run(main, parse_args(sys.argv[1:]))
