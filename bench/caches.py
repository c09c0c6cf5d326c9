"""Cache invalidation benchmarks (issue 4), each against a baseline measured in the
same run.

- write_cost: one transaction (an UPDATE of one row, then COMMIT) on one connection,
  against the same transaction that also invalidates the row's cache entry
  (`caches.invalidate`, sent in COMMIT's round trip), or 100 entries
  (`invalidate_bulk`), and against the same with the
  invalidation row written by a statement of its own (`insert_txn`: what a plain
  stream write costs). Round trips per transaction are counted, not guessed.
- end_to_end: instance A commits transactions that each change a row and invalidate
  it, from 8 tasks; instance B, in a process of its own, applies them. Invalidations/s
  applied on B (first commit to last applied), against the rate A commits the same
  transactions without the invalidation; and again with 100 keys per transaction
  (`invalidate_bulk`).

    python bench/caches.py [--only write_cost|end_to_end] [--reps N] [--transactions N]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

import common
from plait import Database
from plait.caches.invalidations import CACHES_STREAM, Invalidation, as_rows
from plait.instance import Instance
from plait.storage.cache_rows import INSERT_ROWS

REDIS_URL = os.environ.get("PLAIT_BENCH_REDIS", "redis://127.0.0.1:6379/0")
KEYS = 1000


def config(name: str, deployment: str) -> dict[str, Any]:
    return {
        "instance_name": name,
        "deployment": deployment,
        "replication": {"transport": "redis", "redis": {"url": REDIS_URL}},
        "http": {"enabled": False},
        "caches": {"cleanup": False},
    }


async def create_kv(db: Database) -> None:
    async with db.connection() as conn:
        await conn.execute("CREATE TABLE kv (key TEXT PRIMARY KEY, value INT NOT NULL)")
        await conn.execute(
            "INSERT INTO kv SELECT 'k' || g, 0 FROM generate_series(0, %s) g", (KEYS - 1,)
        )


UPDATE = "UPDATE kv SET value = value + 1 WHERE key = %s"


# -- write cost ---------------------------------------------------------------------------------


async def write_cost(db: Database, reps: int, per_rep: int) -> None:
    deployment = f"bench{uuid.uuid4().hex[:8]}"
    a = Instance(config("a", deployment), db=db)
    a.caches.cache("value")
    await a.start()
    gen = a.generator(CACHES_STREAM)
    common.count_round_trips()

    async def plain(i: int) -> None:
        async with db.transaction() as txn:
            await txn.execute(UPDATE, (f"k{i % KEYS}",))

    async def invalidated(i: int) -> None:
        key = f"k{i % KEYS}"
        async with db.transaction() as txn:
            await txn.execute(UPDATE, (key,))
            await a.caches.invalidate(txn, "value", (key,))

    async def bulk(i: int) -> None:
        key = f"k{i % KEYS}"
        async with db.transaction() as txn:
            await txn.execute(UPDATE, (key,))
            await a.caches.invalidate_bulk(
                txn, "value", [(f"k{(i + j) % KEYS}",) for j in range(100)]
            )

    async def own_statement(i: int) -> None:
        key = f"k{i % KEYS}"
        async with db.transaction() as txn:
            await txn.execute(UPDATE, (key,))
            await gen.insert_txn(txn, INSERT_ROWS, (a.name, _rows(key)))

    variants: dict[str, Callable[[int], Awaitable[None]]] = {
        "plain": plain,
        "with_invalidation": invalidated,
        "with_100_invalidations": bulk,
        "invalidation_as_own_statement": own_statement,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    trips: dict[str, float] = {}
    for step in variants.values():  # warm up (prepared statements, caches)
        for i in range(50):
            await step(i)
    for rep in range(reps):
        for name in common.rotated(list(variants), rep):
            step = variants[name]
            before = common.round_trip_snapshot()
            started = time.perf_counter()
            for i in range(per_rep):
                await step(rep * per_rep + i)
            times[name].append((time.perf_counter() - started) / per_rep)
            delta = common.round_trip_delta(before, common.round_trip_snapshot())
            trips[name] = delta.get("caller", 0) / per_rep
    await a.stop()
    base = common.median(times["plain"])
    for name, values in times.items():
        common.emit(
            {
                "figure": "write_cost",
                "variant": name,
                "transactions_per_rep": per_rep,
                "reps": reps,
                "median_us_per_txn": common.rnd(common.median(values) * 1e6, 1),
                "vs_plain": common.rnd(common.median(values) / base, 3),
                "round_trips_per_txn": common.rnd(trips[name], 2),
                "samples_us": [common.rnd(v * 1e6, 1) for v in values],
            }
        )


def _rows(key: str) -> str:
    return as_rows([Invalidation("value", (key,))])


# -- end to end ---------------------------------------------------------------------------------


def receiver_process(conn: Connection, dsn: str, deployment: str) -> None:
    asyncio.run(_receiver(conn, dsn, deployment))


async def _receiver(conn: Connection, dsn: str, deployment: str) -> None:
    """Instance B: a cache of every key, counting invalidations as they are applied."""
    db = await Database.connect(dsn, min_size=1, max_size=4)
    b = Instance(config("b", deployment), db=db)
    cache = b.caches.cache("value", max_entries=KEYS)
    applied = [0, 0.0]

    def count(stream: str, writer: str, token: int, rows: list[Invalidation]) -> None:
        applied[0] += len(rows)
        applied[1] = time.perf_counter()

    b.on_rows(CACHES_STREAM, count)  # after the registry's own listener
    await b.start()
    for i in range(KEYS):
        cache.set((f"k{i}",), i)
    conn.send("ready")
    loop = asyncio.get_running_loop()
    while True:
        told = asyncio.Event()
        loop.add_reader(conn.fileno(), told.set)
        await told.wait()
        loop.remove_reader(conn.fileno())
        message = conn.recv()
        if message == "stop":
            break
        expected: int = message
        async with asyncio.timeout(120):
            while applied[0] < expected:  # noqa: ASYNC110 - counting another loop's work
                await asyncio.sleep(0.001)
        conn.send((applied[0], applied[1], len(cache)))
        applied[0] = 0
    await b.stop()
    await db.close()


async def end_to_end(db: Database, dsn: str, transactions: int, tasks: int = 8) -> None:
    deployment = f"bench{uuid.uuid4().hex[:8]}"
    a = Instance(config("a", deployment), db=db)
    a.caches.cache("value")
    await a.start()
    here, there = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=receiver_process, args=(there, dsn, deployment), daemon=True
    )
    process.start()
    assert await asyncio.to_thread(here.recv) == "ready"
    await asyncio.sleep(1.0)  # connected and caught up

    async def run(n: int, keys_per_txn: int, invalidate: bool) -> tuple[float, float]:
        """Seconds from the first commit to the last commit, and to the last applied."""
        per_task = n // tasks

        async def writer(t: int) -> None:
            for i in range(per_task):
                first = (t * per_task + i) * keys_per_txn
                keys = [f"k{(first + j) % KEYS}" for j in range(keys_per_txn)]
                async with db.transaction() as txn:
                    await txn.execute(UPDATE, (keys[0],))
                    if not invalidate:
                        continue
                    if keys_per_txn == 1:
                        await a.caches.invalidate(txn, "value", (keys[0],))
                    else:
                        await a.caches.invalidate_bulk(txn, "value", [(k,) for k in keys])

        started = time.perf_counter()
        await asyncio.gather(*(writer(t) for t in range(tasks)))
        committed = time.perf_counter()
        if not invalidate:
            return committed - started, 0.0
        expected = per_task * tasks * keys_per_txn
        here.send(expected)
        count, last, _ = await asyncio.to_thread(here.recv)
        assert count == expected, (count, expected)
        return committed - started, last - started

    n = transactions - transactions % tasks
    plain = [(await run(n, 1, False))[0] for _ in range(2)]
    commit_s, applied_s = await run(n, 1, True)
    plain_s = statistics.median(plain)
    common.emit(
        {
            "figure": "end_to_end",
            "keys_per_txn": 1,
            "transactions": n,
            "writer_tasks": tasks,
            "applied_per_s": common.rnd(n / applied_s, 1),
            "committed_txn_per_s": common.rnd(n / commit_s, 1),
            "last_applied_after_last_commit_ms": common.rnd((applied_s - commit_s) * 1e3, 2),
            "plain_txn_per_s": common.rnd(n / plain_s, 1),
            "applied_vs_plain_txn_rate": common.rnd(plain_s / applied_s, 3),
        }
    )
    bulk = max(tasks, n // 10 - (n // 10) % tasks)
    commit_s, applied_s = await run(bulk, 100, True)
    common.emit(
        {
            "figure": "end_to_end",
            "keys_per_txn": 100,
            "transactions": bulk,
            "writer_tasks": tasks,
            "applied_per_s": common.rnd(bulk * 100 / applied_s, 1),
            "committed_txn_per_s": common.rnd(bulk / commit_s, 1),
            "last_applied_after_last_commit_ms": common.rnd((applied_s - commit_s) * 1e3, 2),
        }
    )
    here.send("stop")
    await asyncio.to_thread(process.join, 30)
    await a.stop()


async def main(args: argparse.Namespace) -> None:
    async with (
        common.server(args.dsn) as server_dsn,
        common.bench_schema(server_dsn, "caches") as dsn,
    ):
        db = await Database.connect(dsn, min_size=2, max_size=16)
        await db.migrate()
        await create_kv(db)
        try:
            if args.only in (None, "write_cost"):
                reps = args.reps or (3 if args.quick else 9)
                await write_cost(db, reps, args.writes or (200 if args.quick else 1000))
            if args.only in (None, "end_to_end"):
                n = args.transactions or (2000 if args.quick else 10_000)
                await end_to_end(db, dsn, n)
        finally:
            await db.close()


# --smoke: the smallest sizes that still go through every step.
SMOKE = ["--reps", "1", "--writes", "20", "--transactions", "20"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--only", choices=["write_cost", "end_to_end"])
    parser.add_argument("--reps", type=int, default=0, help="default 9 (--quick: 3)")
    parser.add_argument("--writes", type=int, default=0, help="per rep; default 1000 (200)")
    parser.add_argument(
        "--transactions", type=int, default=0, help="end to end; default 10000 (2000)"
    )
    common.run(main, common.parse(parser, SMOKE))
