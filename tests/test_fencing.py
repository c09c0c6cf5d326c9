"""Fencing dead writers on a real PostgreSQL.

The store-level tests check the proof itself: a fence moves nothing while a connection
of the writer's incarnation lives, moves it once none does, refuses the dead run any
new connection (also one opened while the fence held the row), and never touches a
new run. The process tests kill -9 a writer in the middle of its transactions and
pause one with SIGSTOP, with another writer and a linear reader running.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import time
from collections.abc import AsyncIterator

import psycopg
import pytest

import pace
from fence_helpers import LinearReader, committed, spawn, stop
from plait import Database, FencedError
from plait.storage.incarnation import Incarnation, name_prefix, refuse_if_fenced
from plait.storage.stream_store import StreamStore
from replication_helpers import Seen, cluster_of, connected, write
from stream_helpers import create_generator, create_table, spec_for

INSERT = (
    "INSERT INTO events (stream_id, instance_name, payload)"
    " SELECT {id}, %s, 'p' || g FROM generate_series(1, %s) g RETURNING stream_id"
)


async def row(db: Database, writer: str) -> tuple[int, int | None, bool]:
    async with db.connection() as conn:
        found = await (
            await conn.execute(
                "SELECT stream_id, epoch, fenced_at IS NOT NULL FROM stream_positions"
                " WHERE stream_name = 'events' AND instance_name = %s",
                (writer,),
            )
        ).fetchone()
    assert found is not None
    return found[0], found[1], found[2]


async def test_a_fence_needs_every_connection_of_the_run_gone(db: Database, dsn: str) -> None:
    await create_table(db)
    run = Incarnation.new("w1")
    w1_db = await Database.connect(dsn, incarnation=run)
    w1 = await create_generator(w1_db, ["w1", "w2"], "w1")
    w2 = await create_generator(db, ["w1", "w2"], "w2")  # a shared pool: no incarnation
    store = StreamStore(db, spec_for(["w1", "w2"]))
    assert (await row(db, "w1"))[1] == run.epoch
    assert (await row(db, "w2"))[1] is None
    assert (await store.writers.fence("w2", 100)).epoch is None  # never fenced

    await w1.insert(INSERT, ("w1", 2))
    ids = await w2.insert(INSERT, ("w2", 5))
    result = await store.writers.fence("w1", ids[-1])
    assert (result.epoch, result.position) == (run.epoch, None)
    assert result.alive >= 1
    assert not (await row(db, "w1"))[2]

    await w1.close()
    await w1_db.close()
    result = await store.writers.fence("w1", ids[-1])
    assert (result.epoch, result.alive, result.position) == (run.epoch, 0, ids[-1])
    assert await row(db, "w1") == (ids[-1], run.epoch, True)
    # Never past the sequence, never backwards.
    assert (await store.writers.fence("w1", 10**9)).position == await w2.get_max_allocated_token()
    assert (await store.writers.fence("w1", 1)).position == await w2.get_max_allocated_token()

    # The dead run may open no new connection.
    async with await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name=run.application_name
    ) as conn:
        with pytest.raises(FencedError, match=r"'w1' .* was fenced on events"):
            await refuse_if_fenced(conn, run)

    # A new run registers a new epoch, clears the fence, and is alive.
    rerun = Incarnation.new("w1")
    w1_again_db = await Database.connect(dsn, incarnation=rerun)
    try:
        w1_again = await create_generator(w1_again_db, ["w1", "w2"], "w1")
        assert (await row(db, "w1"))[1:] == (rerun.epoch, False)
        assert (await store.writers.fence("w1", 10**9)).position is None
        await w1_again.close()
    finally:
        await w1_again_db.close()
    await w2.close()


async def test_a_connection_opened_during_a_fence_sees_it(db: Database, dsn: str) -> None:
    """The fence holds the row from before it looks for live connections: a connection
    that starts meanwhile waits for the fence to end, then learns it was fenced."""
    await create_table(db)
    run = Incarnation.new("w1")
    w1_db = await Database.connect(dsn, incarnation=run)
    w1 = await create_generator(w1_db, ["w1", "w2"], "w1")
    await w1.close()
    await w1_db.close()
    async with await psycopg.AsyncConnection.connect(dsn) as fencer:
        await fencer.execute("SELECT 1 FROM stream_positions WHERE instance_name = 'w1' FOR UPDATE")
        late = await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, application_name=run.application_name
        )
        check = asyncio.create_task(refuse_if_fenced(late, run))
        await asyncio.sleep(0.3)
        assert not check.done()  # waits for the fence
        await fencer.execute(
            "UPDATE stream_positions SET fenced_at = now() WHERE instance_name = 'w1'"
        )
        await fencer.commit()
    with pytest.raises(FencedError):
        await check
    await late.close()


async def test_a_connection_refused_to_a_fenced_run_is_closed_at_once(
    db: Database, dsn: str
) -> None:
    """A fenced run that cannot go on as a new incarnation (IDs of it still pending)
    keeps trying to connect: each connection is made under its name, then refused by
    the pool's hook. Before: psycopg_pool drops a connection its hook refused without
    closing it, so its server process lived on, under the fenced run's name, until the
    garbage collector got to it (about a second, in `plait check`'s partitions, each
    retry making another): the run looked alive, and the others could not fence it
    again while its position held them all."""
    await create_table(db)
    run = Incarnation.new("w1")
    w1_db = await Database.connect(dsn, incarnation=run, min_size=2)
    w1 = await create_generator(w1_db, ["w1", "w2"], "w1")
    w1_db.hold_renewal(lambda: True)  # as a writer holding IDs of the fenced run
    store = StreamStore(db, spec_for(["w1", "w2"]))
    gc.disable()  # what the collector would close late, it does not close at all here
    try:
        # Cut off, as a partition ends: every connection of the run gone, and fenced.
        await cut_off(db, run)
        await fenced_within(store, 10.0, "the first fence of w1")

        # Back, the run learns it was fenced, trying to connect again.
        async def select_one() -> None:
            async with w1_db.connection() as conn:
                await conn.execute("SELECT 1")

        with contextlib.suppress(psycopg.OperationalError, FencedError):
            await select_one()  # may find its old connection dead
        with pytest.raises(FencedError):
            await select_one()
        # Its refused connections are gone: the others fence it again.
        await fenced_within(store, 10.0, "w1 fenced again, its refused connections gone")
    finally:
        gc.enable()
        await w1.close()
        await w1_db.close()


async def test_a_fenced_run_renewing_itself_is_not_superseded_by_its_own_renewal(
    db: Database, dsn: str
) -> None:
    """The long run's writer w1 exited with `SupersededError` ("a later run of it
    registered") at its own start: its connections found it fenced, one renewed it (the
    rows moved to the new epoch), and another, checked as the old epoch, found the rows
    under an epoch not its own and took the renewal for a later run, for good. Two new
    connections after a fence: one renews, the other, checked meanwhile, goes on with
    it."""
    await create_table(db)
    run = Incarnation.new("w1")
    w1_db = await Database.connect(dsn, incarnation=run, max_size=8)
    w1 = await create_generator(w1_db, ["w1", "w2"], "w1")
    store = StreamStore(db, spec_for(["w1", "w2"]))
    try:
        await cut_off(db, run)
        await fenced_within(store, 10.0, "the fence of w1")
        # The renewal takes a moment, holding the rows as a fence does (FOR UPDATE), so
        # the other new connections' checks wait for it, then read the moved rows.
        async with db.connection() as conn:
            await conn.execute(
                "CREATE FUNCTION slow_renewal() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                " PERFORM 1 FROM stream_positions WHERE instance_name = OLD.instance_name"
                " FOR UPDATE; PERFORM pg_sleep(0.5); RETURN NEW; END $$;"
                " CREATE TRIGGER slow_renewal BEFORE UPDATE OF epoch ON stream_positions"
                " FOR EACH ROW WHEN (OLD.epoch IS DISTINCT FROM NEW.epoch)"
                " EXECUTE FUNCTION slow_renewal()"
            )

        # Two new connections, as the pool makes them (its hook on each): the first
        # renews; the second is checked while the renewal holds the rows.
        identity = w1_db._identity  # the pool's hook: a race between two of its calls
        conns = [
            await psycopg.AsyncConnection.connect(
                dsn, autocommit=True, application_name=run.application_name
            )
            for _ in range(2)
        ]
        try:
            first = asyncio.create_task(identity.configure(conns[0]))
            await asyncio.sleep(0.2)
            await identity.configure(conns[1])
            await first
        finally:
            for conn in conns:
                await conn.close()
        assert not w1_db.fenced
        assert w1_db.incarnation is not None
        assert w1_db.incarnation.epoch != run.epoch
        with contextlib.suppress(psycopg.OperationalError):  # its old connection died
            await w1.insert(INSERT, ("w1", 1))
        await w1.insert(INSERT, ("w1", 1))  # it writes again
        assert not w1_db.fenced
    finally:
        await w1.close()
        await w1_db.close()


async def cut_off(db: Database, run: Incarnation) -> None:
    """End every server process of `run`, as a partition that ends does."""
    async with db.connection() as conn:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE starts_with(application_name, %s)",
            (name_prefix(run.epoch),),
        )


async def fenced_within(store: StreamStore, within: float, what: str) -> None:
    """Fence w1 as far as it goes, trying until it works (for `within` seconds at this
    machine's pace); fails saying what for."""

    async def fenced() -> bool:
        return (await store.writers.fence("w1", 10**9)).position is not None

    await pace.until(fenced, within, what, every=0.05)


async def test_a_live_writer_holding_a_transaction_is_not_fenced(db: Database, dsn: str) -> None:
    await create_table(db)
    w1_db = await Database.connect(dsn, incarnation=Incarnation.new("w1"))
    w2_db = await Database.connect(dsn, incarnation=Incarnation.new("w2"))
    w1 = await create_generator(w1_db, ["w1", "w2"], "w1", position_flush_interval=0.1)
    w2 = await create_generator(
        w2_db, ["w1", "w2"], "w2", position_flush_interval=0.1, fence_after=0.2
    )
    try:
        async with w1_db.transaction() as txn:
            held = await w1.get_next_txn(txn)
            await w2.insert(INSERT, ("w2", 3))
            await asyncio.sleep(1.0)  # five times fence_after
            assert w2.fences == 0
            assert w2.get_current_token() < held
        # It moves on by itself (its next refresh, 0.1 s on a quiet machine), unfenced.
        await pace.until(
            lambda: w2.get_current_token() > held, 2.0, f"w2's position past {held}", every=0.02
        )
        assert w2.fences == 0
    finally:
        await w1.close()
        await w2.close()
        await w1_db.close()
        await w2_db.close()


@contextlib.asynccontextmanager
async def two_writers_and_a_reader(
    db: Database, dsn: str
) -> AsyncIterator[tuple[LinearReader, dict[str, asyncio.subprocess.Process]]]:
    """Writer processes w1 and w2 (replace one in the dict to restart it: every process
    in it is killed at the end) and a linear reader that fences, in this process."""
    await create_table(db)
    reader_db = await Database.connect(dsn, incarnation=Incarnation.new("reader"))
    reader_gen = await create_generator(
        reader_db, ["w1", "w2"], "reader", position_flush_interval=0.1, fence_after=1.0
    )
    # The reader starts before the writers: made after them, it would start wherever
    # its generator had followed the database to meanwhile, past rows it never read.
    reader = LinearReader(reader_gen)
    writers = {name: await spawn(dsn, name) for name in ("w1", "w2")}
    try:
        yield reader, writers
    finally:
        stop(*writers.values())
        await reader_gen.close()
        await reader_db.close()


@pytest.mark.slow
async def test_a_killed_writer_is_fenced_and_nothing_is_lost(db: Database, dsn: str) -> None:
    async with two_writers_and_a_reader(db, dsn) as (reader, writers):
        await asyncio.sleep(1.0)  # both write, four transactions at a time each
        writers["w1"].send_signal(signal.SIGKILL)
        await writers["w1"].wait()
        head = await reader.gen.get_max_allocated_token()
        # The readers pass everything the dead writer held within 2 s (for a quiet
        # machine: `pace`), while it stays dead.
        took = await reader.until(head, within=2.0)
        print(f"linear position passed the dead writer {took:.2f} s after kill -9")
        # And keep following the live writer, with the dead one fenced along.
        head = await reader.gen.get_max_allocated_token()
        await reader.until(head, within=2.0)

        # A new run of w1 writes again; nothing of it is claimed by the fence.
        writers["w1"] = await spawn(dsn, "w1")
        await asyncio.sleep(1.0)
        stop(*writers.values())
        for process in writers.values():
            await process.wait()
        # Both are dead now: each is fenced up to its own last committed row.
        truth = await committed(db)
        await reader.until(truth[-1][0], within=5.0)
        assert sorted(reader.seen) == truth  # every committed row once, nothing else
        assert sum(1 for _, w in truth if w == "w1") > 0


@pytest.mark.slow
async def test_a_paused_writer_is_not_fenced_while_its_connections_live(
    db: Database, dsn: str
) -> None:
    async with two_writers_and_a_reader(db, dsn) as (reader, writers):
        await asyncio.sleep(0.5)
        w1 = writers["w1"]
        assert w1.pid is not None
        os.kill(w1.pid, signal.SIGSTOP)
        await asyncio.sleep(10.0)
        assert reader.gen.fences == 0
        assert not (await row(db, "w1"))[2]
        os.kill(w1.pid, signal.SIGCONT)
        await asyncio.sleep(1.0)
        stop(*writers.values())
        for process in writers.values():
            await process.wait()
        assert not (await row(db, "w1"))[2]  # killed only now: not fenced yet
        truth = await committed(db)
        await reader.until(max(i for i, w in truth if w == "w2"), within=5.0)
        assert sorted(reader.seen) == [r for r in truth if r[0] <= reader.linear]


@pytest.mark.slow
async def test_over_replication_a_killed_instance_is_fenced_and_its_rows_reach_readers(
    db: Database, dsn: str
) -> None:
    """w1 runs as an Instance in its own process, w2 (the TCP hub) and r in this one:
    when w1 dies mid-transaction, a fence's POSITION makes r read its last committed
    rows from the database, each once, and r's linear position moves on."""
    async with cluster_of(db, "tcp", hub="w2") as cluster:
        seen = Seen()
        w2 = await cluster.start(cluster.instance("w2"))
        reader = cluster.instance("r")
        reader.on_rows("events", seen.on_rows)
        r = await cluster.start(reader)
        await connected(w2, r)
        w1 = await spawn(dsn, "w1", {**cluster.config("w1"), "database": dsn})
        try:
            await pace.until(
                lambda: sum(1 for row in seen.rows if row[2] == "w1") >= 20,
                10,
                "20 rows of w1 at r",
            )
            w1.send_signal(signal.SIGKILL)
            await w1.wait()
            killed = time.monotonic()
            for i in range(5):
                await write(w2, f"after-{i}")
            truth = await committed(db)
            last_w1 = max(i for i, w in truth if w == "w1")
            gen = r.generator("events")
            await pace.until(
                lambda: gen.get_current_token() >= truth[-1][0],
                5.0,
                f"r's linear position to pass the dead w1, to {truth[-1][0]}",
            )
            took = time.monotonic() - killed
            print(f"r's linear position passed the dead w1 {took:.2f} s after kill -9")
            # Every committed row of both writers reached r once, w1's last ones read
            # from the database after the fence; nothing w1 did not commit.
            assert sorted((row[1], row[2]) for row in seen.rows) == truth
            assert gen.get_current_token_for_writer("w1") >= last_w1
            assert w2.generator("events").fences + gen.fences >= 1
        finally:
            stop(w1)


async def test_a_fence_stalled_mid_transaction_holds_the_writers_row_briefly(
    db: Database, dsn: str
) -> None:
    """A fencer that stops between its statements (SIGSTOP, a partition: its socket
    looks alive to the server) holding a writer's row lock: the writer's durable
    position store waited for the session's idle_in_transaction_session_timeout (60 s).
    The row lock is bounded by ROW_LOCK_IDLE_LIMIT now, and the fencer's next step is
    a lost connection, tried again."""
    await create_table(db)
    w1 = await create_generator(db, ["w1", "w2"], "w1")
    await w1.insert(INSERT, ("w1", 3))
    fencer_db = await Database.connect(dsn)
    store = StreamStore(fencer_db, spec_for(["w1", "w2"]))
    try:
        waited: list[float] = []

        async def stalled_fence() -> None:
            async with store.writers._row_transaction() as txn:
                assert await store.writers._locked_row(txn, "w1") is not None
                started = time.monotonic()
                # The writer stores its position meanwhile: it waits for the row.
                async with (
                    pace.within(30, "w1's row, locked by the stalled fence"),
                    db.connection() as conn,
                ):
                    await conn.execute(
                        "UPDATE stream_positions SET updated_at = now()"
                        " WHERE stream_name = 'events' AND instance_name = 'w1'"
                    )
                waited.append(time.monotonic() - started)
                await txn.execute("SELECT 1")  # the stalled fencer goes on

        with pytest.raises(psycopg.OperationalError, match="ended a transaction"):
            await stalled_fence()
        locked = waited[0]
        assert locked < pace.scaled(20), f"w1's row was locked {locked:.1f} s by a stalled fence"
        assert (await store.writers.fence("w1", 10**9)).epoch is None  # a new connection answers
    finally:
        await fencer_db.close()
        await w1.close()
