"""Write path: rows/s through plait against bare inserts on the same sequence.

Figures (one JSON line each): single-row transactions and 100-row batches, with 1 and 4
writer processes, for the three plait styles:
- `insert`: `await gen.insert("INSERT ... VALUES ({id}, ...) RETURNING stream_id", ...)`:
  the statement takes its own IDs, one round trip, autocommit;
- `get_next`: `async with gen.get_next() as sid:` around `async with db.transaction()`
  (batches: `get_next_mult(100)`);
- `get_next_txn`: `sid = await gen.get_next_txn(txn)` inside `db.transaction()`
  (batches: `get_next_mult_txn(txn, 100)`).
The baseline (`bare`) is an autocommit `INSERT ... VALUES (nextval('events_seq'), ...)`
on a plain psycopg 3 async connection: one statement, its own transaction (batches: one
multi-row INSERT with nextval per row). `bare_txn` is the same statement wrapped in
psycopg's `conn.transaction()` (BEGIN, INSERT, COMMIT: three round trips).
Two more baselines do what `get_next` and `get_next_txn` do, without plait: take the
IDs first (`SELECT nextval(...) FROM generate_series(1, n)`), then INSERT them:
`bare_id_first` takes them in autocommit, then BEGIN / INSERT / COMMIT (like
`get_next`); `bare_id_first_txn` takes them inside the transaction (like
`get_next_txn`). Each plait style is also reported against its equivalent.

Each writer is its own spawned process with its own asyncio loop, plait `Database`
(default pool) and generator; with 4 processes they are the 4 writers of one stream.
Every process runs one write at a time. Variants alternate in rotating order (A B C D,
B C D A, ...); each phase starts on an emptied table; the figure is the median over
repetitions. Round trips to the server (waits for an answer; see
`common.count_round_trips`) are counted in the worker processes and reported per write.
The workers also know the diagnostic variants of `write_breakdown.py`.

Run: python bench/write_path.py [--quick] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from psycopg import AsyncConnection

from common import (
    EVENTS_DDL,
    add_common_args,
    bench_schema,
    count_round_trips,
    emit,
    find_postmaster,
    log,
    median,
    parse,
    rnd,
    rotated,
    round_trip_delta,
    round_trip_snapshot,
    run,
    server,
    server_cpu_seconds,
    server_info,
)
from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec

TARGET = 0.90
BATCH = 100
PAYLOAD = "payload-0123456789abcdef"
VARIANTS = (
    "plait_insert",
    "plait_get_next",
    "plait_get_next_txn",
    "bare",
    "bare_txn",
    "bare_id_first",
    "bare_id_first_txn",
)
STYLE_OF = {
    "plait_insert": "insert",
    "plait_get_next": "get_next",
    "plait_get_next_txn": "get_next_txn",
}
# The bare pattern that does what each plait style does (the ID before or in the INSERT).
EQUIVALENT = {
    "plait_insert": "bare",
    "plait_get_next": "bare_id_first",
    "plait_get_next_txn": "bare_id_first_txn",
}
NEXTVALS = "SELECT nextval('events_seq') FROM generate_series(1, %s)"


def spec_for(writers: list[str]) -> StreamSpec:
    return StreamSpec(
        name="events",
        sequence="events_seq",
        tables=[TableSpec("events", id_column="stream_id", instance_column="instance_name")],
        writers=writers,
    )


def insert_sql(n: int) -> str:
    values = ", ".join(["(%s, %s, %s)"] * n)
    return f"INSERT INTO events (stream_id, instance_name, payload) VALUES {values}"


def plait_insert_sql(n: int) -> str:
    """The bare statement, with plait's `{id}` where the bare one calls nextval."""
    values = ", ".join(["({id}, %s, %s)"] * n)
    return (
        f"INSERT INTO events (stream_id, instance_name, payload) VALUES {values}"
        " RETURNING stream_id"
    )


def bare_sql(n: int) -> str:
    values = ", ".join(["(nextval('events_seq'), %s, %s)"] * n)
    return f"INSERT INTO events (stream_id, instance_name, payload) VALUES {values}"


# -- worker process ----------------------------------------------------------------------------

EMULATED_UPSERT = (
    "INSERT INTO stream_positions (stream_name, instance_name, stream_id) VALUES (%s, %s, %s)"
    " ON CONFLICT (stream_name, instance_name) DO UPDATE SET stream_id = EXCLUDED.stream_id"
    " WHERE stream_positions.stream_id < EXCLUDED.stream_id"
)


class EmulatedPositions:
    """plait's background position upserts re-done with plain psycopg (for the
    breakdown): poked after each write, one upsert in flight at a time.

    `pipelined` sends what plait sends (a pipeline holding BEGIN, SET LOCAL
    synchronous_commit TO off, the upsert, COMMIT, on a pooled connection); otherwise one
    autocommit statement on a dedicated connection whose session has
    synchronous_commit off.
    """

    def __init__(self, db: Database, dedicated: AsyncConnection[Any], instance: str) -> None:
        self.db = db
        self.dedicated = dedicated
        self.instance = instance
        self.pipelined = True
        self.position = 0
        self.written = 0
        self.upserts = 0
        self._wake = asyncio.Event()
        # Named like plait's task so its round trips are counted as `positions`.
        self.task = asyncio.create_task(self._run(), name="plait-positions-bench-emulation")

    def poke(self, position: int) -> None:
        self.position = max(self.position, position)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            value = self.position
            if value <= self.written:
                continue
            params = ("emulated", self.instance, value)
            if self.pipelined:
                async with self.db.connection() as conn, conn.pipeline(), conn.transaction():
                    await conn.execute("SET LOCAL synchronous_commit TO off")
                    await conn.execute(EMULATED_UPSERT, params)
            else:
                await self.dedicated.execute(EMULATED_UPSERT, params)
            self.written = value
            self.upserts += 1

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@dataclass
class Worker:
    instance: str
    db: Database
    gen: MultiWriterIdGenerator
    bare: AsyncConnection[Any]
    emulated: EmulatedPositions
    sql: dict[str, str] = field(default_factory=dict)

    def plait_params(self, ids: list[int]) -> list[Any]:
        return [v for sid in ids for v in (sid, self.instance, PAYLOAD)]

    def bare_params(self, n: int) -> list[Any]:
        return [v for _ in range(n) for v in (self.instance, PAYLOAD)]

    # plait, the two documented styles

    async def plait_get_next(self, n: int) -> None:
        if n == 1:
            async with self.gen.get_next() as sid, self.db.transaction() as txn:
                await txn.execute(self.sql["insert_1"], (sid, self.instance, PAYLOAD))
            return
        async with self.gen.get_next_mult(n) as ids, self.db.transaction() as txn:
            await txn.execute(self.sql[f"insert_{n}"], self.plait_params(ids))

    async def plait_get_next_txn(self, n: int) -> None:
        async with self.db.transaction() as txn:
            if n == 1:
                sid = await self.gen.get_next_txn(txn)
                await txn.execute(self.sql["insert_1"], (sid, self.instance, PAYLOAD))
            else:
                ids = await self.gen.get_next_mult_txn(txn, n)
                await txn.execute(self.sql[f"insert_{n}"], self.plait_params(ids))

    async def plait_insert(self, n: int) -> None:
        """One statement taking its own IDs: one round trip, like the bare INSERT."""
        await self.gen.insert(self.sql[f"plait_insert_{n}"], self.bare_params(n))

    # baselines

    async def bare_auto(self, n: int) -> None:
        await self.bare.execute(self.sql[f"bare_{n}"], self.bare_params(n))

    async def bare_txn(self, n: int) -> None:
        async with self.bare.transaction():
            await self.bare.execute(self.sql[f"bare_{n}"], self.bare_params(n))

    async def bare_id_first(self, n: int) -> None:
        cur = await self.bare.execute(NEXTVALS, (n,))
        ids = sorted(int(r[0]) for r in await cur.fetchall())
        async with self.bare.transaction():
            await self.bare.execute(self.sql[f"insert_{n}"], self.plait_params(ids))

    async def bare_id_first_txn(self, n: int) -> None:
        async with self.bare.transaction():
            cur = await self.bare.execute(NEXTVALS, (n,))
            ids = sorted(int(r[0]) for r in await cur.fetchall())
            await self.bare.execute(self.sql[f"insert_{n}"], self.plait_params(ids))

    async def bare_txn_pipelined(self, n: int) -> None:
        """BEGIN sent with the INSERT in one pipeline, then COMMIT: what plait's
        `db.transaction()` sends since it pipelines BEGIN (2 round trips)."""
        async with self.bare.pipeline():
            await self.bare.execute("BEGIN")
            await self.bare.execute(self.sql[f"bare_{n}"], self.bare_params(n))
        await self.bare.execute("COMMIT")

    # breakdown: plait's SQL pattern with plain psycopg over the same pool

    async def emulated_nextval_txn(self, n: int) -> int:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                "SELECT nextval(%s::regclass) FROM generate_series(1, %s)", ("events_seq", n)
            )
            ids = sorted(int(r[0]) for r in await cur.fetchall())
        async with self.db.connection() as conn, conn.transaction():
            await conn.execute(self.sql[f"insert_{n}"], self.plait_params(ids))
        return ids[-1]

    async def emul_nextval_txn(self, n: int) -> None:
        await self.emulated_nextval_txn(n)

    async def emul_nextval_pipelined_txn(self, n: int) -> None:
        """`emul_nextval_txn` with BEGIN pipelined with the INSERT (3 round trips)."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                "SELECT nextval(%s::regclass) FROM generate_series(1, %s)", ("events_seq", n)
            )
            ids = sorted(int(r[0]) for r in await cur.fetchall())
        async with self.db.connection() as conn:
            async with conn.pipeline():
                await conn.execute("BEGIN")
                await conn.execute(self.sql[f"insert_{n}"], self.plait_params(ids))
            await conn.execute("COMMIT")

    async def emul_nextval_txn_upsert(self, n: int) -> None:
        self.emulated.poke(await self.emulated_nextval_txn(n))

    def step(self, variant: str) -> Callable[[int], Awaitable[None]]:
        steps: dict[str, Callable[[int], Awaitable[None]]] = {
            "plait_insert": self.plait_insert,
            "plait_get_next": self.plait_get_next,
            "plait_get_next_txn": self.plait_get_next_txn,
            "plait_get_next_no_upserts": self.plait_get_next,
            "plait_get_next_txn_no_upserts": self.plait_get_next_txn,
            "bare": self.bare_auto,
            "bare_txn": self.bare_txn,
            "bare_id_first": self.bare_id_first,
            "bare_id_first_txn": self.bare_id_first_txn,
            "bare_txn_pipelined": self.bare_txn_pipelined,
            "emul_nextval_txn": self.emul_nextval_txn,
            "emul_nextval_pipelined_txn": self.emul_nextval_pipelined_txn,
            "emul_nextval_txn_upsert_pipelined": self.emul_nextval_txn_upsert,
            "emul_nextval_txn_upsert_1rt": self.emul_nextval_txn_upsert,
        }
        return steps[variant]

    async def phase(self, variant: str, n: int, start_at: float, duration: float) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        step = self.step(variant)
        writer = self.gen._position_writer
        assert writer is not None
        if variant.endswith("_no_upserts"):
            # Diagnostic only: plait's upsert after each write is skipped (the periodic
            # idle flush, at most one a second, still runs).
            writer.poke = _no_poke  # type: ignore[method-assign]
        self.emulated.pipelined = variant.endswith("_pipelined")
        rt_before = round_trip_snapshot()
        alloc_before = self.gen._allocator.round_trips
        upserts_before = writer.upserts + self.emulated.upserts
        writes = 0
        cpu_start = time.process_time()
        start = time.perf_counter()
        deadline = start + duration
        try:
            while time.perf_counter() < deadline:
                await step(n)
                writes += 1
            elapsed = time.perf_counter() - start
            # Let the position upsert poked by the last write finish, so it is counted.
            await asyncio.sleep(0.02)
            cpu = time.process_time() - cpu_start
        finally:
            if "poke" in vars(writer):
                del writer.poke
        return {
            "rows": writes * n,
            "writes": writes,
            "elapsed": elapsed,
            "cpu": cpu,
            "round_trips": round_trip_delta(rt_before, round_trip_snapshot()),
            "allocator_round_trips": self.gen._allocator.round_trips - alloc_before,
            "upserts": writer.upserts + self.emulated.upserts - upserts_before,
        }


def _no_poke() -> None:
    pass


async def _worker_main(dsn: str, instance: str, writers: list[str], pipe: Connection) -> None:
    count_round_trips()
    db = await Database.connect(dsn, application_name=f"bench-{instance}")
    gen = await MultiWriterIdGenerator.create(db, spec_for(writers), instance)
    bare = await AsyncConnection.connect(dsn, autocommit=True, application_name="bench-bare")
    dedicated = await AsyncConnection.connect(
        dsn, autocommit=True, application_name="bench-upserts"
    )
    await dedicated.execute("SET synchronous_commit TO off")
    emulated = EmulatedPositions(db, dedicated, instance)
    worker = Worker(instance, db, gen, bare, emulated)
    for n in (1, BATCH):
        worker.sql[f"insert_{n}"] = insert_sql(n)
        worker.sql[f"bare_{n}"] = bare_sql(n)
        worker.sql[f"plait_insert_{n}"] = plait_insert_sql(n)
    pipe.send(("ready", None))
    try:
        while True:
            command = await asyncio.to_thread(pipe.recv)
            if command[0] == "stop":
                break
            _, variant, n, start_at, duration = command
            pipe.send(("done", await worker.phase(variant, n, start_at, duration)))
    finally:
        await emulated.close()
        await gen.close()
        await dedicated.close()
        await bare.close()
        await db.close()


def worker_entry(dsn: str, instance: str, writers: list[str], pipe: Connection) -> None:
    try:
        asyncio.run(_worker_main(dsn, instance, writers, pipe))
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        raise
    finally:
        pipe.send(("exit", None))


# -- parent ------------------------------------------------------------------------------------


class Fleet:
    """The writer processes of one stream, driven phase by phase."""

    def __init__(self, dsn: str, count: int, postmaster: int | None) -> None:
        self.postmaster = postmaster
        ctx = multiprocessing.get_context("spawn")
        self.names = [f"w{i + 1}" for i in range(count)]
        self.pipes: list[Connection] = []
        self.procs: list[Any] = []
        for name in self.names:
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=worker_entry, args=(dsn, name, self.names, theirs), daemon=True
            )
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)

    async def _receive(self, pipe: Connection) -> Any:
        kind, payload = await asyncio.to_thread(pipe.recv)
        if kind == "error":
            raise RuntimeError(f"worker failed:\n{payload}")
        return payload

    async def ready(self) -> None:
        await asyncio.gather(*(self._receive(p) for p in self.pipes))

    async def phase(
        self, variant: str, n: int, duration: float, start_delay: float = 0.05
    ) -> tuple[list[dict[str, Any]], float | None]:
        """Per-worker results, and the server's CPU seconds over the phase (if local)."""
        before = server_cpu_seconds(self.postmaster)
        start_at = time.time() + start_delay
        for pipe in self.pipes:
            pipe.send(("run", variant, n, start_at, duration))
        results = list(await asyncio.gather(*(self._receive(p) for p in self.pipes)))
        after = server_cpu_seconds(self.postmaster)
        return results, (after - before if after is not None and before is not None else None)

    async def stop(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(("stop",))
        for proc in self.procs:
            await asyncio.to_thread(proc.join, 30)
            if proc.is_alive():
                proc.terminate()


@dataclass
class Tally:
    """Samples of one variant: rows/s per phase, and summed counters."""

    samples: list[float] = field(default_factory=list)
    writes: int = 0
    rows: int = 0
    upserts: int = 0
    cpu: float = 0.0
    server_cpu: float | None = 0.0
    allocator_round_trips: int = 0
    round_trips: dict[str, int] = field(default_factory=dict)

    def add(self, phase: tuple[list[dict[str, Any]], float | None]) -> None:
        results, server_cpu = phase
        self.samples.append(sum(r["rows"] / r["elapsed"] for r in results))
        if self.server_cpu is not None:
            self.server_cpu = None if server_cpu is None else self.server_cpu + server_cpu
        for r in results:
            self.writes += r["writes"]
            self.rows += r["rows"]
            self.upserts += r["upserts"]
            self.cpu += r["cpu"]
            self.allocator_round_trips += r["allocator_round_trips"]
            for kind, count in r["round_trips"].items():
                self.round_trips[kind] = self.round_trips.get(kind, 0) + count

    def cpu_us_per_write(self) -> float:
        """Client CPU (the writer process: caller and plait's background tasks) per write."""
        return rnd(self.cpu / max(self.writes, 1) * 1e6, 1)

    def server_cpu_us_per_write(self) -> float | None:
        """Server CPU (all PostgreSQL processes, when local) per write; includes whatever
        else the server did meanwhile, so it is an upper bound."""
        if self.server_cpu is None:
            return None
        return rnd(self.server_cpu / max(self.writes, 1) * 1e6, 1)

    def per_write(self) -> dict[str, float]:
        w = max(self.writes, 1)
        kinds = {k: rnd(v / w, 3) for k, v in sorted(self.round_trips.items())}
        return {"total": rnd(sum(self.round_trips.values()) / w, 3), **kinds}


Reporter = Callable[[int, int, int, float, dict[str, "Tally"]], None]


async def run_group(
    dsn: str,
    writers: int,
    shapes: list[int],
    variants: tuple[str, ...],
    reps: int,
    phase_s: float,
    warmup_s: float,
    reporter: Reporter,
) -> None:
    """Start `writers` processes on a fresh stream; measure each variant and shape."""
    async with await AsyncConnection.connect(dsn, autocommit=True) as admin:
        db = await Database.connect(dsn)
        try:
            await db.migrate()
        finally:
            await db.close()
        await admin.execute(EVENTS_DDL)
        postmaster = await find_postmaster(admin)
        log(f"{writers} writer process(es): starting")
        fleet = Fleet(dsn, writers, postmaster)
        try:
            await fleet.ready()
            for n in shapes:
                tallies = {v: Tally() for v in variants}
                for variant in variants:
                    await admin.execute("TRUNCATE events")
                    await fleet.phase(variant, n, warmup_s)
                for rep in range(reps):
                    for variant in rotated(variants, rep):
                        await admin.execute("TRUNCATE events")
                        tallies[variant].add(await fleet.phase(variant, n, phase_s))
                    log(
                        f"writers={writers} batch={n} rep {rep + 1}/{reps}: "
                        + ", ".join(f"{v}={tallies[v].samples[-1]:.0f}" for v in variants)
                    )
                reporter(writers, n, reps, phase_s, tallies)
        finally:
            await fleet.stop()


def report(writers: int, n: int, reps: int, phase_s: float, tallies: dict[str, Tally]) -> None:
    bare = tallies["bare"]
    bare_txn = tallies["bare_txn"]
    bare_rate = median(bare.samples)
    bare_txn_rate = median(bare_txn.samples)
    for variant, style in STYLE_OF.items():
        plait = tallies[variant]
        rate = median(plait.samples)
        equivalent = tallies[EQUIVALENT[variant]]
        equivalent_rate = median(equivalent.samples)
        paired_equivalent = [p / b for p, b in zip(plait.samples, equivalent.samples, strict=True)]
        paired = [p / b for p, b in zip(plait.samples, bare.samples, strict=True)]
        ratio = rate / bare_rate
        emit(
            {
                "bench": "write_single_row" if n == 1 else f"write_batch_{n}",
                "writers": writers,
                "style": style,
                "rows_per_txn": n,
                "plait_rows_per_s": rnd(rate, 1),
                "bare_rows_per_s": rnd(bare_rate, 1),
                "ratio": rnd(ratio, 3),
                "target": TARGET,
                "meets_target": ratio >= TARGET,
                "bare_txn_rows_per_s": rnd(bare_txn_rate, 1),
                "ratio_vs_bare_txn": rnd(rate / bare_txn_rate, 3),
                "ratio_paired_median": rnd(median(paired), 3),
                "equivalent_bare": EQUIVALENT[variant],
                "equivalent_bare_rows_per_s": rnd(equivalent_rate, 1),
                "ratio_vs_equivalent": rnd(rate / equivalent_rate, 3),
                "ratio_vs_equivalent_paired_median": rnd(median(paired_equivalent), 3),
                "equivalent_client_cpu_us_per_write": equivalent.cpu_us_per_write(),
                "reps": reps,
                "phase_s": phase_s,
                "plait_samples": [rnd(s, 1) for s in plait.samples],
                "bare_samples": [rnd(s, 1) for s in bare.samples],
                "bare_txn_samples": [rnd(s, 1) for s in bare_txn.samples],
                "equivalent_samples": [rnd(s, 1) for s in equivalent.samples],
                "plait_round_trips_per_write": plait.per_write(),
                "bare_round_trips_per_write": bare.per_write(),
                "bare_txn_round_trips_per_write": bare_txn.per_write(),
                "plait_client_cpu_us_per_write": plait.cpu_us_per_write(),
                "bare_client_cpu_us_per_write": bare.cpu_us_per_write(),
                "bare_txn_client_cpu_us_per_write": bare_txn.cpu_us_per_write(),
                "plait_server_cpu_us_per_write": plait.server_cpu_us_per_write(),
                "bare_server_cpu_us_per_write": bare.server_cpu_us_per_write(),
                "bare_txn_server_cpu_us_per_write": bare_txn.server_cpu_us_per_write(),
                "plait_position_upserts_per_write": rnd(plait.upserts / max(plait.writes, 1), 3),
                "plait_allocator_round_trips_per_write": rnd(
                    plait.allocator_round_trips / max(plait.writes, 1), 3
                ),
            }
        )


async def run_groups(
    args: argparse.Namespace,
    name: str,
    shapes: list[int],
    variants: tuple[str, ...],
    timing: tuple[int, float, float],
    report_fn: Reporter,
) -> None:
    """One group of variants per writer count, each in a fresh schema."""
    reps, phase_s, warmup_s = timing
    started = time.perf_counter()
    async with server(args.dsn) as server_dsn:
        log(f"server: {await server_info(server_dsn)}")
        for writers in args.writers:
            async with bench_schema(server_dsn, f"{name}{writers}") as dsn:
                await run_group(dsn, writers, shapes, variants, reps, phase_s, warmup_s, report_fn)
    log(f"done in {time.perf_counter() - started:.0f} s")


async def main(args: argparse.Namespace) -> None:
    timing = (
        args.reps or (3 if args.quick else 5),
        args.phase or (0.25 if args.quick else 1.2),
        0.1 if args.quick else 0.5,
    )
    await run_groups(args, "write", [1, BATCH], VARIANTS, timing, report)


# --smoke: the smallest sizes that still go through every step.
SMOKE = ["--quick", "--reps", "1", "--phase", "0.05"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--reps", type=int, default=0, help="repetitions per variant")
    parser.add_argument("--phase", type=float, default=0.0, help="seconds per phase")
    parser.add_argument(
        "--writers", type=int, nargs="+", default=[1, 4], help="writer process counts"
    )
    return parse(parser, SMOKE, argv)


if __name__ == "__main__":
    run(main, parse_args(sys.argv[1:]))
