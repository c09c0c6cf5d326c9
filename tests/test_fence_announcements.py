"""Fence announcements are facts (R-ID-14, issue 18): a holder of the deployment's
secret that says another writer was fenced is believed only once the database shows
it. Instances on a real PostgreSQL, over a real Redis or real TCP sockets, all with
the secret; one of them (`x`, a reader) lies about writer w2 while w2 holds an ID.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest
from psycopg import sql

import pace
from fence_helpers import committed, spawn, stop
from plait.core.commands import Fenced, Position
from plait.instance import Instance
from replication_helpers import Cluster, Seen, connected, metric, write

pytestmark = pytest.mark.timeout(120)

SECRET = "the deployment's secret"


async def started(
    cluster: Cluster, name: str, seen: Seen | None = None, **overrides: Any
) -> Instance:
    instance = cluster.instance(name, replication={"secret": SECRET}, **overrides)
    if seen is not None:
        instance.on_rows("events", seen.on_rows)
    return await cluster.start(instance)


async def test_a_fence_the_database_does_not_show_is_refused(cluster: Cluster) -> None:
    """`x` announces w2 fenced at the head while w2 holds a lower ID in an open
    transaction. Believed, the reader would catch up w2 from the database (the row is
    not there yet), move past it, and drop it when it arrives: a row skipped. Both the
    old form (a POSITION with prev == new on w2's behalf) and FENCED are refused."""
    if cluster.transport == "tcp":
        await started(cluster, "hub")
    seen = Seen()
    w1 = await started(cluster, "w1")
    w2 = await started(cluster, "w2")
    r = await started(cluster, "r", seen)
    x = await started(cluster, "x")
    await connected(w1, w2, r, x)
    first = await write(w1, "first")
    await seen.wait(1)

    gen2 = w2.generator("events")
    async with gen2.get_next() as held, w2.db.transaction() as txn:
        await txn.execute(
            sql.SQL("INSERT INTO events VALUES (%s, %s, %s)"),
            (held, "w2", "held.0"),
        )
        above = await write(w1, "above")
        await seen.wait(2)
        x.send_command(Position("events", "w2", above, above))
        x.send_command(Fenced("events", "w2", above))
        await pace.until(
            lambda: metric(r, "plait_refused_positions_total", stream="events") >= 1,
            30,
            "r to refuse the forged POSITION of w2",
        )
        await asyncio.sleep(0.5)  # the forged POSITION, had it been taken, shows by now
        reader = r.generator("events")
        assert reader.get_current_token_for_writer("w2") < held
        assert reader.get_persisted_upto_position() < held
    await seen.wait(3)
    ids = sorted(row[1] for row in seen.rows)
    assert ids == sorted([first, held, above])


async def test_a_real_fence_reaches_a_reader_that_does_not_fence(
    cluster: Cluster, dsn: str
) -> None:
    """The fence as plait makes it: w2, a process of its own, dies by kill -9 in the
    middle of its transactions; w1 (or the TCP hub) fences it (its row moves, stamped
    fenced) and announces it; the reader, which fences nobody itself, checks the row and follows,
    reading w2's last committed rows from the database."""
    if cluster.transport == "tcp":
        await started(cluster, "hub")
    seen = Seen()
    w1 = await started(cluster, "w1")
    r = await started(cluster, "r", seen, fence_after=None)
    await connected(w1, r)
    config = cluster.config("w2", replication={"secret": SECRET}, database=dsn)
    w2 = await spawn(dsn, "w2", config)
    try:
        await pace.until(
            lambda: sum(1 for row in seen.rows if row[2] == "w2") >= 20, 30, "20 rows of w2 at r"
        )
        w2.send_signal(signal.SIGKILL)
        await w2.wait()
        later = [await write(w1, f"later{i}") for i in range(3)]
        reader = r.generator("events")
        await pace.until(
            lambda: reader.get_persisted_upto_position() >= later[-1],
            30,
            f"r's persisted-up-to position to reach w1's later row {later[-1]}",
        )
        truth = await committed(cluster.db)
        await pace.until(
            lambda: len(seen.rows) >= len(truth), 30, f"all {len(truth)} committed rows at r"
        )
        assert sorted((row[1], row[2]) for row in seen.rows) == truth
        fencers = [i for i in cluster.instances if i is not r]  # w1, and the TCP hub
        assert sum(i.generator("events").fences for i in fencers) >= 1
        assert reader.fences == 0
        assert metric(r, "plait_refused_positions_total", stream="events") == 0
    finally:
        stop(w2)
