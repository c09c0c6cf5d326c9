"""The checker's processes: `python -m plait.check.roles ROLE NAME PLAN_JSON`.

Each records what it did or saw in its journal and follows the orchestrator's control
file: writers write until the phase is "idle", readers read until told to "stop" and
say when they have caught up with the targets the orchestrator computed.

A writer exits with `FENCED_EXIT` when it learns it was fenced (all its connections
were cut for longer than `fence_after`) and cannot go on as a new incarnation (IDs of
the fenced run still pending): a fenced run must not write again, and the orchestrator
restarts it as an operator would. One that went on journals `S renewed EPOCH`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import logging
import os
import random
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import psycopg

from plait.caches.invalidations import CACHES_STREAM, Invalidation
from plait.check.control import POLL, Control, read_until_stopped
from plait.check.journal import Journal, Kind
from plait.check.plan import (
    DB_LINEAR,
    FOLLOWER,
    KV_CACHE,
    KV_CHANGED,
    KV_KEYS,
    LINEAR,
    SPARK,
    WORKER,
    Plan,
    read_control,
)
from plait.check.seen import Seen
from plait.config import InstanceConfig
from plait.errors import DatabaseUnavailableError, FencedError, InstanceRunningError
from plait.instance import Instance
from plait.storage.database import Database
from plait.streams.generator import MultiWriterIdGenerator

FENCED_EXIT = 3
# A writer that could not reach PostgreSQL as it started (restarted while the server was
# down, or the server went down during its start): the orchestrator starts it again,
# as an operator's supervisor would.
UNAVAILABLE_EXIT = 4
SIZES = (1, 1, 2, 3, 5, 8, 13)  # IDs per transaction
ROLLBACK_SHARE = 0.05
KV_SHARE = 0.25
PAGE = 10_000  # rows a linear reader reads per query: a backlog goes in a few

logger = logging.getLogger("plait.check")


class _Rollback(Exception):
    pass


async def views(journal: Journal, gens: dict[str, MultiWriterIdGenerator]) -> None:
    """Journal this process's view of every writer's position when it changed, each
    second: where one process stopped hearing of another shows in a failed run."""
    last: dict[str, str] = {}
    while True:
        for s, gen in gens.items():
            view = json.dumps(gen.get_positions(), separators=(",", ":"), sort_keys=True)
            if last.get(s) != view:
                journal.write(Kind.VIEW, s, view)
                last[s] = view
        await asyncio.sleep(1.0)


# -- writer -----------------------------------------------------------------------------------


async def writer(plan: Plan, name: str) -> None:
    journal = Journal(plan.journal(name))
    rng = random.Random()
    control = Control(plan)
    # Slow commits asked of an earlier run of this writer are not this one's to make.
    slow_taken = Control.count(read_control(plan.control), "slow", name)
    slow_made = Journal(plan.slow_made)
    instance = Instance(plan.instance_config(name))
    try:
        await instance.start()
    except (DatabaseUnavailableError, InstanceRunningError, psycopg.Error) as err:
        # PostgreSQL unreachable, or gone in the middle of the start (a restart or a
        # crash), or this writer's previous run still connected after the patience: the
        # start fails with the error printed, as plait's does (a crash, away from a
        # PostgreSQL fault).
        logger.error("writer %s: could not start: %s", name, err)
        journal.write(Kind.STATE, "unavailable")
        os._exit(UNAVAILABLE_EXIT)  # nothing of this run ever wrote
    gens = {s: instance.generator(s) for s in plan.stream_names}
    journal.write(Kind.STATE, "started")
    print("started", flush=True)
    for s, gen in gens.items():
        journal.write(Kind.POSITION, s, gen.get_current_token_for_writer(name))
    follow = asyncio.create_task(control.follow())
    inserts = {
        s: f"INSERT INTO {plan.table(s)} (stream_id, instance_name, payload)"
        " SELECT unnest(%s::bigint[]), %s, unnest(%s::text[])"
        for s in plan.stream_names
    }
    fenced = asyncio.Event()
    fetches = itertools.count()
    incarnation = instance.db.incarnation

    def renewed() -> None:
        """Journal a new incarnation (this run was fenced, and went on) once."""
        nonlocal incarnation
        now = instance.db.incarnation
        if now is not None and now != incarnation:
            incarnation = now
            journal.write(Kind.STATE, "renewed", now.epoch)

    async def one() -> None:
        nonlocal slow_taken
        began_as = instance.db.incarnation
        index = rng.randrange(plan.streams)
        s = plan.stream_names[index]
        slow = control.orders("slow", name) > slow_taken
        if slow:
            slow_taken += 1
        ids: list[int] = []
        fetch = next(fetches)
        # Journalled before the IDs are asked for: a writer paused while they are on
        # their way holds its position, and the judge must know it does.
        journal.write(Kind.FETCH, s, fetch)
        try:
            async with instance.db.transaction() as txn:
                try:
                    ids = await gens[s].get_next_mult_txn(txn, rng.choice(SIZES) * plan.batch)
                finally:  # the fetch ended, with IDs or without
                    renewed()  # before IDs the new incarnation took
                    journal.write(Kind.ARRIVED, s, ",".join(map(str, ids)) or "-", fetch)
                payloads = [f"{name}:{i}" for i in ids]
                await txn.execute(inserts[s], (ids, name, payloads))
                if not slow and rng.random() < KV_SHARE:
                    # Never in a slow transaction: its row lock would hold up the others.
                    key = rng.randrange(KV_KEYS)
                    await txn.execute(
                        "UPDATE check_kv SET version = GREATEST(version, %s)"
                        " WHERE s = %s AND k = %s",
                        (ids[0], index, key),
                    )
                    await instance.caches.invalidate_batch(txn, KV_CHANGED, (index, ids[0]), [key])
                if slow:
                    journal.write(Kind.STATE, "slow", s, ",".join(map(str, ids)))
                    slow_made.write(Kind.STATE, name)
                await asyncio.sleep(plan.slow_commit if slow else rng.uniform(0, 0.01))
                if rng.random() < ROLLBACK_SHARE:
                    raise _Rollback
        except _Rollback:
            journal.ids(Kind.ROLLED_BACK, s, ids)
            return
        except FencedError:
            now = instance.db.incarnation
            if now is not None and now != began_as:
                # Begun by the fenced run, which has gone on as a new incarnation since:
                # this transaction failed, the writer did not (it is not fenced twice).
                if ids:
                    journal.ids(Kind.FAILED, s, ids)
                return
            fenced.set()
            return
        except Exception as err:  # a cut connection: the database says what committed
            if ids:
                journal.ids(Kind.FAILED, s, ids)
            logger.info("writer %s: transaction failed: %s", name, err)
            await asyncio.sleep(0.05)
            return
        journal.ids(Kind.COMMITTED, s, ids)

    async def loop() -> None:
        while control.phase == "run" and not fenced.is_set():
            await one()

    async def positions() -> None:
        last: dict[str, int] = {}
        while True:
            renewed()
            for s, gen in gens.items():
                position = gen.get_current_token_for_writer(name)
                if last.get(s) != position:
                    journal.write(Kind.POSITION, s, position)
                    last[s] = position
            await asyncio.sleep(0.25)

    tracker = asyncio.create_task(positions())
    viewer = asyncio.create_task(
        views(journal, {**gens, CACHES_STREAM: instance.generator(CACHES_STREAM)})
    )
    loops = [asyncio.create_task(loop()) for _ in range(plan.concurrency)]
    await asyncio.gather(*loops)
    if fenced.is_set():
        journal.write(Kind.STATE, "fenced")
        os._exit(FENCED_EXIT)  # as a crash: nothing of this run may touch the database again
    journal.write(Kind.STATE, "idle")
    print("idle", flush=True)
    await control.until("stop")
    tracker.cancel()
    viewer.cancel()
    follow.cancel()
    await instance.stop()
    for s, gen in gens.items():
        journal.write(Kind.POSITION, s, gen.get_current_token_for_writer(name))
    journal.write(Kind.STATE, "stopped")


# -- readers ----------------------------------------------------------------------------------


async def follower(plan: Plan, name: str) -> None:
    """Every writer's rows over replication, by per-writer token."""
    seen = Seen(Journal(plan.journal(name)))
    control = Control(plan)
    instance = Instance(plan.instance_config(name))

    def on_rows(stream: str, writer: str, token: int, rows: list[Any]) -> None:
        seen.rows(stream, writer, (r["stream_id"] for r in rows))
        seen.token(stream, writer, token)

    def on_position(stream: str, writer: str, token: int) -> None:
        seen.token(stream, writer, token)

    for s in plan.stream_names:
        instance.on_rows(s, on_rows)
        instance.on_position(s, on_position)
    await _run_reader(instance, seen, control, "writers")


async def linear(plan: Plan, name: str) -> None:
    """The linear position, from replication or (`dblinear`) from the database alone;
    rows read from the database up to it."""
    seen = Seen(Journal(plan.journal(name)))
    control = Control(plan)
    moved = asyncio.Event()
    instance: Instance | None = None
    db: Database | None = None
    if name == LINEAR:
        instance = Instance(plan.instance_config(name))
        for s in plan.stream_names:
            instance.on_position(s, lambda *_: moved.set())
        await instance.start()
        gens = {s: instance.generator(s) for s in plan.stream_names}
    else:
        db = await Database.connect(plan.dsn, max_size=4)
        config = InstanceConfig.load(plan.instance_config(name))
        gens = {
            c.name: await MultiWriterIdGenerator.create(
                db, c.to_spec(), name, position_flush_interval=config.position_flush_interval
            )
            for c in config.streams
        }
    seen.journal.write(Kind.STATE, "started")
    print("started", flush=True)
    follow = asyncio.create_task(control.follow())
    viewer = asyncio.create_task(views(seen.journal, gens))
    read = asyncio.create_task(read_until_stopped(seen, control, "linear"))
    positions = {s: gen.get_current_token() for s, gen in gens.items()}
    for s, position in positions.items():
        seen.token(s, "*", position)
    while not read.done():
        moved.clear()  # before reading: a move meanwhile wakes the next round at once
        try:
            if db is not None:
                for gen in gens.values():
                    await gen.refresh_positions()
            for s, gen in gens.items():
                target = gen.get_current_token()
                while positions[s] < target:
                    rows, upto, _ = await gen.get_updates_since(None, positions[s], target, PAGE)
                    seen.rows(s, "*", (r.stream_id for r in rows))
                    positions[s] = upto
                    seen.token(s, "*", upto)
        except DatabaseUnavailableError as err:
            # Reads outlast a restart by themselves; a longer outage: go on trying.
            logger.warning("%s: %s", name, err)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(POLL):
                await moved.wait()
    follow.cancel()
    viewer.cancel()
    if instance is not None:
        await instance.stop()  # closes its generators
    if db is not None:
        for gen in gens.values():
            await gen.close()
        await db.close()


async def worker(plan: Plan, name: str) -> None:
    """Serves check_kv from a cache the writers' transactions invalidate, and checks
    that no value older than an invalidation it has applied is ever served."""
    seen = Seen(Journal(plan.journal(name)))
    control = Control(plan)
    instance = Instance(plan.instance_config(name))
    required: dict[tuple[int, int], int] = {}

    @instance.caches.pseudo_cache(KV_CHANGED)
    def expand(index: int, version: int, keys: tuple[int, ...]) -> Iterator[tuple[str, Any]]:
        for key in keys:
            # Applied before the stream's position moves: from now on, no read may serve
            # a value older than this version.
            required[(index, key)] = max(required.get((index, key), 0), version)
            yield KV_CACHE, (index, key)

    @instance.caches.cached(name=KV_CACHE)
    async def kv(index: int, key: int) -> int:
        async with instance.db.connection() as conn:
            cur = await conn.execute(
                "SELECT version FROM check_kv WHERE s = %s AND k = %s", (index, key)
            )
            row = await cur.fetchone()
        return 0 if row is None else int(row[0])

    def on_rows(stream: str, writer: str, token: int, rows: list[Invalidation]) -> None:
        for row in rows:
            if row.cache_name == KV_CHANGED and row.keys is not None:
                seen.rows(f"kv.s{row.keys[0]}", "*", [int(row.keys[1])])
        seen.token(stream, writer, token)

    instance.on_rows(CACHES_STREAM, on_rows)
    instance.on_position(CACHES_STREAM, lambda s, w, t: seen.token(s, w, t))

    async def serve() -> None:
        rng = random.Random()
        served = stale = failed = 0
        while control.phase != "stop":
            index, key = rng.randrange(plan.streams), rng.randrange(KV_KEYS)
            floor = required.get((index, key), 0)
            try:
                value = await kv(index, key)
            except psycopg.OperationalError as err:
                # PostgreSQL went away (a failed load stores nothing): serve on once
                # it is back, as an application would answer its next request.
                failed += 1
                if failed == 1 or failed % 100 == 0:
                    logger.warning("%s: loading a value failed (%d so far): %s", name, failed, err)
                await asyncio.sleep(0.1)
                continue
            served += 1
            if value < floor:
                stale += 1
                seen.journal.write(Kind.VIOLATION, "stale", f"s{index}", key, f"{value}<{floor}")
            await asyncio.sleep(0.002)
        cache = kv.cache
        seen.journal.write(Kind.STATE, "served", served, cache.hits, cache.misses, stale, failed)

    await _run_reader(instance, seen, control, "caches", serve)


async def _run_reader(
    instance: Instance,
    seen: Seen,
    control: Control,
    targets_key: str,
    also: Callable[[], Coroutine[Any, Any, None]] | None = None,
) -> None:
    """Start `instance`, then read (and run `also`) until told to stop."""
    await instance.start()
    seen.journal.write(Kind.STATE, "started")
    print("started", flush=True)
    follow = asyncio.create_task(control.follow())
    extra = asyncio.create_task(also()) if also is not None else None
    gens = {c.name: instance.generator(c.name) for c in instance.config.streams}
    gens[CACHES_STREAM] = instance.generator(CACHES_STREAM)
    viewer = asyncio.create_task(views(seen.journal, gens))
    await read_until_stopped(seen, control, targets_key)
    viewer.cancel()
    if extra is not None:
        await extra  # its failure is the run's
    follow.cancel()
    await instance.stop()


async def spark(plan: Plan, name: str) -> None:
    from plait.check.spark_reader import spark_reader  # pyspark only where it is used

    await spark_reader(plan, name)


ROLES = {
    "writer": writer,
    FOLLOWER: follower,
    LINEAR: linear,
    DB_LINEAR: linear,
    WORKER: worker,
    SPARK: spark,
}


def dump_tasks() -> None:
    """Log the stack of every task of this process (on SIGUSR1, from the orchestrator
    when something did not catch up): where each one waits."""
    for task in asyncio.all_tasks():
        out = io.StringIO()
        task.print_stack(limit=12, file=out)
        logger.warning("task %s:\n%s", task.get_name(), out.getvalue().rstrip())


async def _with_dumps(
    role: Callable[[Plan, str], Coroutine[Any, Any, None]], plan: Plan, name: str
) -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
    await role(plan, name)


def main() -> None:
    role, name, plan = sys.argv[1], sys.argv[2], Plan.from_json(sys.argv[3])
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"
    )
    # Connections and catch-ups, for whoever reads a failed run: a few lines per event.
    logging.getLogger("plait.replication.redis_transport").setLevel(logging.DEBUG)
    logging.getLogger("plait.replication.handler").setLevel(logging.INFO)
    logging.getLogger("plait.check").setLevel(logging.INFO)
    asyncio.run(_with_dumps(ROLES[role], plan, name))


if __name__ == "__main__":
    main()
