"""Group commit: 100 concurrent single-row writers in one process, each insert its own
transaction (`gen.insert`) against the same writers through a `Batcher` (issue 22).

Each of `--tasks` tasks writes one row at a time, as fast as it can, for `--seconds`;
the two variants alternate, `--reps` times. Figures (one JSON line per variant, then the
comparison):
- rows per second, the p50 and p99 of one call, and transactions per row (distinct
  xmin of the rows written);
- `batched_vs_single_rows_per_s`: the ratio of the medians (target >= 5x);
- `p99_vs_linger_plus_commit`: the batched p99 over `--linger` plus one commit of a
  full batch (`--max-batch` rows in one transaction, alone, p50 in the same run); target
  <= 1. `lone_commit_p50_ms` is a lone insert's, for scale.

Run: python bench/group_commit.py [--quick] [--dsn DSN] [--tasks 100] [--linger 0.002]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable

from common import (
    EVENTS_DDL,
    add_common_args,
    bench_schema,
    emit,
    log,
    median,
    parse,
    percentile,
    rnd,
    run,
    server,
    server_info,
)
from plait import Batcher, Database, MultiWriterIdGenerator, StreamSpec, TableSpec

SPEC = StreamSpec("events", sequence="events_seq", tables=[TableSpec("events")], writers=["w1"])
ROW = (
    "INSERT INTO events (stream_id, instance_name, payload) VALUES ({id}, 'w1', %s)"
    " RETURNING stream_id"
)
PAYLOAD = "x" * 100  # rows of about 100 bytes


async def load(
    insert: Callable[[str, tuple[str]], Awaitable[list[int]]], tasks: int, seconds: float
) -> tuple[int, list[float], float]:
    """Rows written, each call's seconds, and the wall time, for `tasks` writers."""
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    async def writer() -> None:
        while time.perf_counter() < stop:
            started = time.perf_counter()
            await insert(ROW, (PAYLOAD,))
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(writer() for _ in range(tasks)))
    return len(latencies), latencies, time.perf_counter() - started


async def transactions_per_row(db: Database) -> float:
    async with db.connection() as conn:
        cur = await conn.execute("SELECT count(DISTINCT xmin::text), count(*) FROM events")
        row = await cur.fetchone()
        await conn.execute("TRUNCATE events")
    assert row is not None
    return int(row[0]) / max(1, int(row[1]))


async def main(args: argparse.Namespace) -> None:
    seconds = 1.0 if args.quick else args.seconds
    reps = 2 if args.quick else args.reps
    async with server(args.dsn) as server_dsn:
        log(f"server: {await server_info(server_dsn)}")
        async with bench_schema(server_dsn, "group_commit") as dsn:
            db = await Database.connect(dsn, max_size=args.pool)
            try:
                await db.migrate()
                async with db.connection() as c:
                    await c.execute(EVENTS_DDL)
                gen = await MultiWriterIdGenerator.create(db, SPEC, "w1")
                try:
                    await figures(db, gen, args, seconds, reps)
                finally:
                    await gen.close()
            finally:
                await db.close()


async def figures(
    db: Database, gen: MultiWriterIdGenerator, args: argparse.Namespace, seconds: float, reps: int
) -> None:
    lone: list[float] = []
    for _ in range(reps):  # one commit: a lone writer's insert
        _, latencies, _ = await load(gen.insert, 1, seconds / 2)
        lone.extend(latencies)
        await transactions_per_row(db)
    commit = median(lone)
    full: list[float] = []
    for _ in range(max(10, reps * 10)):  # one commit of a full batch, alone
        started = time.perf_counter()
        async with db.transaction() as txn:
            await gen.insert_many_txn(txn, ROW, [(PAYLOAD,)] * args.max_batch)
        full.append(time.perf_counter() - started)
    await transactions_per_row(db)
    batch_commit = median(full)
    runs: dict[str, list[tuple[float, list[float], float]]] = {"single": [], "batched": []}
    for rep in range(reps):
        for variant in ("single", "batched") if rep % 2 == 0 else ("batched", "single"):
            if variant == "single":
                rows, latencies, wall = await load(gen.insert, args.tasks, seconds)
            else:
                async with Batcher(gen, linger=args.linger, max_batch=args.max_batch) as b:
                    rows, latencies, wall = await load(b.insert, args.tasks, seconds)
            per_row = await transactions_per_row(db)
            runs[variant].append((rows / wall, latencies, per_row))
            log(f"{variant}: {rows / wall:.0f} rows/s, {per_row:.3f} transactions per row")
    summary: dict[str, dict[str, float]] = {}
    for variant, results in runs.items():
        all_latencies = [s for _, latencies, _ in results for s in latencies]
        summary[variant] = {
            "rows_per_s": median([rate for rate, _, _ in results]),
            "p50_ms": median(all_latencies) * 1e3,
            "p99_ms": percentile(all_latencies, 0.99) * 1e3,
            "transactions_per_row": median([per_row for _, _, per_row in results]),
        }
        emit(
            {
                "figure": "group_commit",
                "variant": variant,
                "tasks": args.tasks,
                **{key: rnd(value, 3) for key, value in summary[variant].items()},
                "reps": reps,
                "seconds": seconds,
            }
        )
    bound_ms = (args.linger + batch_commit) * 1e3
    emit(
        {
            "figure": "group_commit_vs_single",
            "tasks": args.tasks,
            "linger_ms": args.linger * 1e3,
            "max_batch": args.max_batch,
            "batched_vs_single_rows_per_s": rnd(
                summary["batched"]["rows_per_s"] / summary["single"]["rows_per_s"], 2
            ),
            "lone_commit_p50_ms": rnd(commit * 1e3, 3),
            "full_batch_commit_p50_ms": rnd(batch_commit * 1e3, 3),
            "p99_vs_linger_plus_commit": rnd(summary["batched"]["p99_ms"] / bound_ms, 2),
            "targets": "rows/s >= 5x; p99 <= linger + one commit",
        }
    )


# --smoke: the smallest sizes that still go through every step.
SMOKE = ["--tasks", "10", "--seconds", "0.2", "--reps", "1"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--tasks", type=int, default=100, help="concurrent writer tasks")
    parser.add_argument("--seconds", type=float, default=3.0, help="per variant and rep")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--linger", type=float, default=0.002, help="the Batcher's linger")
    parser.add_argument("--max-batch", type=int, default=100, help="the Batcher's max_batch")
    parser.add_argument("--pool", type=int, default=10, help="connections in the pool")
    args = parse(parser, SMOKE, argv)
    if args.tasks < 1 or args.reps < 1 or args.max_batch < 1 or args.seconds <= 0:
        parser.error("--tasks, --reps and --max-batch must be at least 1, --seconds above 0")
    return args


if __name__ == "__main__":
    run(main, parse_args(sys.argv[1:]))
