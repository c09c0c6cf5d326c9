"""A writer cut off from PostgreSQL while it holds an ID: its server processes must end,
and the others' linear position pass it, within a bound its settings give.

A real partition, not a mock: the writer is a process whose connection goes through a
proxy that stops forwarding both ways and closes nothing (`CutProxy.black_hole`). The
proxy's kernel still acknowledges every packet, so TCP keepalives (the server's and the
client's) and `tcp_user_timeout` never fire through it; what ends the writer's server
process there is `idle_in_transaction_session_timeout`. Keepalives bound a partition of
a direct connection, where nothing answers the server's probes: the second test cuts
one in the kernel (a veth pair between two network namespaces, as root), with plait's
default settings.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import pace
from pg_proxy import proxy_in_front
from plait import Database
from plait.storage.incarnation import Incarnation, name_prefix
from plait.storage.timeouts import DatabaseTimeouts
from stream_helpers import create_generator, create_table

ROLE = Path(__file__).with_name("partition_roles.py")
INSERT = (
    "INSERT INTO events (stream_id, instance_name, payload)"
    " SELECT {id}, %s, 'p' || g FROM generate_series(1, %s) g RETURNING stream_id"
)
# Small, so the test is quick; the assertions allow three times what they add up to.
IDLE_IN_TRANSACTION = 1.0
FENCE_AFTER = 0.5


async def spawn_holder(
    dsn: str, name: str, timeouts: dict[str, Any] | None
) -> tuple[Any, int, int]:
    """The writer process, the ID it holds in its open transaction, and its epoch."""
    # A statement well within the timeout: alive, it is never idle in its transaction.
    every = IDLE_IN_TRANSACTION / 5
    args: dict[str, Any] = {"dsn": dsn, "name": name, "writers": ["w1", "w2"], "every": every}
    if timeouts is not None:
        args["timeouts"] = timeouts
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROLE),
        json.dumps(args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    line = await pace.wait(process.stdout.readline(), 30, f"writer {name} to say it holds an ID")
    if not line.startswith(b"holding "):
        process.kill()
        raise AssertionError(f"the writer did not start: {line!r} {await process.stderr.read()!r}")
    _, held, epoch = line.split()
    return process, int(held), int(epoch)


async def backends_of(db: Database, epoch: int) -> int:
    """Server processes whose application_name says they belong to run `epoch` (the
    server is shared: other tests' writers are named w1 too)."""
    async with db.connection() as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE starts_with(application_name, %s)",
            (name_prefix(epoch),),
        )
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def wait_for(what: str, check: Any, within: float) -> float:
    """Seconds until `await check()` is true; fails saying what it waited for after
    `within` seconds at this machine's pace."""
    limit = pace.scaled(within)
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > limit:
            raise AssertionError(f"waited {limit:.1f} s for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def test_a_writer_partitioned_in_a_transaction_is_fenced_within_the_bound(
    db: Database, dsn: str
) -> None:
    await create_table(db)
    reader_db = await Database.connect(dsn, incarnation=Incarnation.new("reader"))
    reader = await create_generator(
        reader_db, ["w1", "w2"], "reader", position_flush_interval=0.1, fence_after=FENCE_AFTER
    )
    w2 = await create_generator(db, ["w1", "w2"], "w2", position_flush_interval=0.1)
    timeouts = {
        "idle_in_transaction_session_timeout": IDLE_IN_TRANSACTION,
        # Through the proxy these never fire (see the module's docstring); small anyway.
        "keepalives_idle": 1,
        "keepalives_interval": 1,
        "keepalives_count": 1,
        "tcp_user_timeout": 1.0,
    }
    holder = None
    try:
        async with proxy_in_front(dsn) as (proxy, through):
            holder, held, epoch = await spawn_holder(through, "w1", timeouts)
            ids = await w2.insert(INSERT, ("w2", 3))
            assert ids[0] > held
            # Alive and holding: not fenced, the readers wait for it.
            await asyncio.sleep(3 * max(FENCE_AFTER, IDLE_IN_TRANSACTION))
            assert await backends_of(db, epoch) == 1
            assert reader.fences == 0
            assert reader.get_current_token() < held

            proxy.black_hole()
            bound = IDLE_IN_TRANSACTION + FENCE_AFTER
            gone = await wait_for(
                "w1's server process (idle in its transaction, cut off) to end",
                lambda: _none(backends_of(db, epoch)),
                within=3 * bound,
            )
            passed = await wait_for(
                f"the reader's linear position to pass w1's held ID {held}",
                lambda: _true(reader.get_current_token() >= ids[-1]),
                within=3 * bound,
            )
            print(
                f"w1's backend ended {gone:.2f} s into the partition; fenced {passed:.2f} s later"
            )
            assert reader.fences == 1
            assert holder.returncode is None  # the writer lives on, cut off

            # Healed, the writer hears its session was ended, and its row was never
            # committed: the fence claimed nothing it could still write.
            proxy.heal()
            assert holder.stdout is not None
            ended = await pace.wait(
                holder.stdout.readline(), 30, "the healed writer to say its session ended"
            )
            assert ended.startswith(b"ended IdleInTransactionSessionTimeout: "), ended
            async with db.connection() as conn:
                cursor = await conn.execute(
                    "SELECT count(*) FROM events WHERE stream_id = %s", (held,)
                )
                assert await cursor.fetchone() == (0,)
    finally:
        if holder is not None and holder.returncode is None:
            holder.kill()
            await holder.wait()
        await reader.close()
        await w2.close()
        await reader_db.close()


async def _none(count: Any) -> bool:
    return int(await count) == 0


async def _true(value: bool) -> bool:
    return value


def _can_cut_cables() -> bool:
    """Root, with network namespaces and veth pairs (the kernel partition needs them)."""
    if os.geteuid() != 0 or not all(shutil.which(c) for c in ("unshare", "nsenter", "ip")):
        return False
    probe = ["unshare", "--net", "ip", "link", "add", "va", "type", "veth", "peer", "name", "vb"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_cut_cables(), reason="needs root, network namespaces and veth")
def test_a_writer_cut_off_by_the_network_is_fenced_within_the_default_bound() -> None:
    """Every connection of the writer, idle ones too, ends by the server's keepalives
    (or tcp_user_timeout, for an unacknowledged answer) within `dead_after`; the reader
    passes it `fence_after` later. With the defaults: 6 s, and 1 s more."""
    dead_after = DatabaseTimeouts().dead_after
    assert dead_after is not None
    fence_after = 1.0
    bound = dead_after + fence_after
    driver = str(ROLE.with_name("partition_kernel.py"))
    within = pace.scaled(3 * bound)  # the kernel takes it as it is
    args = json.dumps({"within": within, "fence_after": fence_after})
    done = pace.run(
        ["unshare", "--net", sys.executable, driver, args],
        120 + 3 * bound,
        capture_output=True,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    lines = done.stdout.decode().splitlines()
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert lines, done.stderr.decode()[-3000:]
    result = json.loads(lines[-1])
    print(f"kernel partition: {result}")
    assert result["connections"] >= 2  # idle pooled connections too, not only transactions
    assert result["gone"] is not None, (
        f"w1's {result['connections']} server processes still alive {within:.1f} s after the cut"
    )
    assert result["passed"] is not None, (
        f"the reader's linear position did not pass w1 within {within:.1f} s of the cut"
    )
