"""Rollback: how long after a rolled-back transaction its IDs count as finished.

A transaction that took IDs (`get_next_mult_txn`) and rolled back finishes its IDs only
after a flush of PostgreSQL's WAL (R-ID-14: the sequence's log record must survive a
crash first), one round trip later. Figures (one JSON line each):
- `plait`: from the end of `async with db.transaction()` (rolled back) until this
  writer's position passes the IDs, p50 and p99;
- `baseline`: the same transaction without plait on a plain psycopg connection (BEGIN,
  nextval, ROLLBACK), end to end, p50 and p99; and the ratio of the p50s.
Variants alternate, one sample each, `--samples` times.

Run: python bench/rollback.py [--quick] [--dsn DSN] [--samples 500]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from psycopg import AsyncConnection

from common import (
    EVENTS_DDL,
    add_common_args,
    bench_schema,
    emit,
    log,
    parse,
    percentile,
    rnd,
    run,
    server,
    server_info,
)
from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec
from plait.streams.outbox import Outbox

SPEC = StreamSpec("events", sequence="events_seq", tables=[TableSpec("events")], writers=["w1"])


class _Rollback(Exception):
    pass


async def plait_sample(
    db: Database, gen: MultiWriterIdGenerator, outbox: Outbox, moved: asyncio.Event
) -> float:
    """Seconds from the rollback's return until the IDs count as finished."""
    ids: list[int] = []
    moved.clear()
    try:
        async with db.transaction() as txn:
            ids = await gen.get_next_mult_txn(txn, 1)
            raise _Rollback
    except _Rollback:
        pass
    ended = time.perf_counter()
    while gen.get_current_token_for_writer("w1") < ids[-1]:
        await moved.wait()  # the outbox posted a move
        moved.clear()
    took = time.perf_counter() - ended
    outbox.sent_upto(ids[-1])  # nothing sends them here: forget them
    return took


async def baseline_sample(conn: AsyncConnection[object]) -> float:
    """Seconds for BEGIN, nextval and ROLLBACK on a plain connection."""
    started = time.perf_counter()
    async with conn.transaction(force_rollback=True):
        await conn.execute("SELECT nextval('events_seq')")
    return time.perf_counter() - started


async def main(args: argparse.Namespace) -> None:
    samples = 50 if args.quick else args.samples
    async with server(args.dsn) as server_dsn:
        log(f"server: {await server_info(server_dsn)}")
        async with bench_schema(server_dsn, "rollback") as dsn:
            db = await Database.connect(dsn, max_size=4)
            conn = await AsyncConnection.connect(dsn, autocommit=True)
            try:
                await db.migrate()
                async with db.connection() as c:
                    await c.execute(EVENTS_DDL)
                gen = await MultiWriterIdGenerator.create(db, SPEC, "w1")
                moved = asyncio.Event()
                outbox = gen.open_outbox(moved.set)
                try:
                    plait: list[float] = []
                    base: list[float] = []
                    for _ in range(samples):
                        plait.append(await plait_sample(db, gen, outbox, moved))
                        base.append(await baseline_sample(conn))
                finally:
                    await gen.close()
            finally:
                await conn.close()
                await db.close()
    ms = 1000.0
    emit(
        {
            "figure": "rolled-back IDs finished after (plait) vs a bare rollback",
            "plait_p50_ms": rnd(statistics.median(plait) * ms, 3),
            "plait_p99_ms": rnd(percentile(plait, 0.99) * ms, 3),
            "baseline_p50_ms": rnd(statistics.median(base) * ms, 3),
            "baseline_p99_ms": rnd(percentile(base, 0.99) * ms, 3),
            "ratio_p50": rnd(statistics.median(plait) / statistics.median(base), 2),
            "samples": samples,
        }
    )


# --smoke: the smallest sizes that still go through every step.
SMOKE = ["--samples", "10"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--samples", type=int, default=500, help="samples per variant")
    return parse(parser, SMOKE, argv)


if __name__ == "__main__":
    run(main, parse_args(sys.argv[1:]))
