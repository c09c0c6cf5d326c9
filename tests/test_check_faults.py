"""The checker survives its own faults (issue 18, finding 8): a fault that cannot be
injected is counted and retried, never an abort of the run.

Before: `pg_terminate` connected to PostgreSQL to find a writer's backends, and a
refused connection (`too many clients`, or the server down) raised out of the fault
schedule: the run ended with a traceback and no verdict.

And the checker's `pg_partition`: a writer's database connections black-holed by its
fault proxy for longer than the keepalive bound, then dropped, then healed.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import psycopg
import pytest
from rich.console import Console

import pace
from pg_proxy import proxy_in_front
from plait.check import journal
from plait.check.options import Options
from plait.check.plan import Plan, keepalive_bound
from plait.check.process import CheckedProcess
from plait.check.report import Report
from plait.check.run import Checker
from plait.check.table import summary
from plait.ports import free_port
from plait.storage.timeouts import DatabaseTimeouts

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def live_writer(tmp_path: Path) -> AsyncIterator[CheckedProcess]:
    """A process the checker takes for a live writer (it only needs a target)."""
    refusing = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres?connect_timeout=2"
    plan = Plan(
        dsn=refusing, transport="tcp", run_dir=tmp_path, writers=("w0",), streams=1, fence_after=1.0
    )
    proc = CheckedProcess("writer", "w0", plan)
    proc.proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(60)"
    )
    proc.said.add("started")
    try:
        yield proc
    finally:
        proc.proc.kill()
        await proc.proc.wait()


async def test_a_terminate_fault_against_a_server_that_refuses_is_counted_not_raised(
    live_writer: CheckedProcess,
) -> None:
    checker = Checker(Options(dsn=live_writer._plan.dsn, seed=1))
    checker.plan = live_writer._plan
    checker.writers = [live_writer]
    assert await checker._fault("pg_terminate") is False  # retried later by the schedule
    assert await checker._fault("pg_terminate") is False
    assert checker.faults.counts["pg_terminate"] == 0
    assert checker.faults.failed["pg_terminate"] == 2
    assert "connection" in checker.faults.last_failure["pg_terminate"].lower()
    report = Report(
        options=checker.options,
        seed=1,
        run_dir=live_writer._plan.run_dir,
        elapsed=1.0,
        committed=0,
        rolled_back=0,
        failed=0,
        faults=checker.faults,
        readers=[],
        own_regressions=[],
    )
    console = Console(record=True, width=200)
    for table in summary(report):
        console.print(table)
    assert "could not inject: pg_terminate" in console.export_text()
    assert report.to_json()["could_not_inject"] == {"pg_terminate": 2}


async def test_a_process_that_did_not_start_or_died_says_why(tmp_path: Path) -> None:
    """Before: "spark did not start:" came with an empty log, and a reader that died
    showed only as rows lost; the cause was in its own files alone."""
    plan = Plan(dsn="", transport="tcp", run_dir=tmp_path, writers=(), streams=1, fence_after=1.0)
    reader = CheckedProcess("no-such-role", "spark", plan)  # exits at once: an unknown role
    await reader.spawn()
    assert not await reader.until("started", 30)
    why = await reader.why_not("started", 30)
    assert "spark did not say 'started': exited with 1" in why
    assert "KeyError: 'no-such-role'" in why
    assert str(tmp_path / "spark.log") in why
    checker = Checker(Options(seed=1))
    checker.plan, checker.readers = plan, [reader]
    assert checker._reader_deaths() == {"spark": "exited with 1: KeyError: 'no-such-role'"}


async def test_a_partition_holds_every_byte_then_drops_what_it_held(dsn: str) -> None:
    """The proxy's part of `pg_partition`, on a real PostgreSQL: while black-holed, a
    connection's query gets no answer and its server process lives on (the proxy's
    kernel answers for both ends); `drop_all()` ends it both ways, as keepalives would;
    a connection begun meanwhile waits, and is made once the partition heals."""
    name = "plait-partition-probe"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as watcher:

        async def backends() -> int:
            cur = await watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
            )
            row = await cur.fetchone()
            return int(row[0]) if row else 0

        async with proxy_in_front(dsn) as (proxy, through):
            conn = await psycopg.AsyncConnection.connect(
                through, autocommit=True, application_name=name
            )
            assert await backends() == 1
            proxy.black_hole()
            query = asyncio.create_task(conn.execute("SELECT 1"))
            late = asyncio.create_task(
                psycopg.AsyncConnection.connect(through, autocommit=True, application_name=name)
            )
            await asyncio.sleep(0.5)
            assert not query.done()  # held, not answered, not refused
            assert not late.done()
            assert await backends() == 1  # the server does not know
            assert proxy.drop_all() == 1
            with pytest.raises(psycopg.OperationalError):
                await query
            await pace.until(
                _zero(backends), 10.0, "the partitioned server process to end", every=0.05
            )
            assert not late.done()  # the partition goes on for new connections
            proxy.heal()
            healed = await pace.wait(late, 10, "the connection begun in the partition, healed")
            async with healed:
                cur = await healed.execute("SELECT 1")
                assert await cur.fetchone() == (1,)
            await conn.close()


def _zero(count: Callable[[], Awaitable[int]]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await count() == 0

    return check


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_partitioned_writer_is_fenced_within_the_bound_and_goes_on(
    server_dsn: str, tmp_path: Path
) -> None:
    """One `pg_partition` in a checker run of two writers, on a server the test named
    (a partition touches only the run's own writer connections): the verdict is clean,
    and the journals show the partition did what it claims. The writer is black-holed
    for longer than the keepalive bound its `database_timeouts` give; its connections
    are dropped then; the linear readers pass what it held while it is still cut off
    (the others fenced it); healed, it goes on as a new incarnation or, with IDs of
    the fenced run still pending, exits fenced and is restarted."""
    options = Options(
        dsn=server_dsn,
        transport="tcp",
        writers=2,
        streams=1,
        duration=14.0,  # the partition lasts about 10 s, and ends before the drain
        faults=1,
        kinds=("pg_partition",),
        run_dir=tmp_path,
    )
    report = await Checker(options).run()
    assert report.ok, "\n".join(report.problems) + f"\n(journals in {report.run_dir})"
    bound = keepalive_bound(DatabaseTimeouts())  # the writers' timeouts: the defaults
    assert report.keepalive_bound == bound == 6.0
    assert dict(report.faults.counts) == {"pg_partition": 1}
    assert not report.faults.failed
    [(writer, [partition])] = report.faults.partitions.items()
    assert partition.cut is not None
    assert partition.healed is not None
    assert partition.cut - partition.hole >= bound
    assert partition.healed - partition.hole >= bound + options.fence_after + 2.0
    dropped = [
        line
        for line in journal.read(tmp_path / "faults.journal")
        if line.fields[:2] == ("cut", writer)
    ]
    assert int(dropped[0].fields[2]) >= 1  # it had connections, and lost them all

    # The linear readers passed what the writer held while it was still cut off: only
    # a fence could move its position then (it publishes through the database).
    for reader in ("linear", "dblinear"):
        tokens = [
            (line.t, int(line.fields[2]))
            for line in journal.read(tmp_path / f"{reader}.journal")
            if line.kind == "W"
        ]
        before = max(p for t, p in tokens if t <= partition.hole)
        moved = [t for t, p in tokens if partition.cut <= t < partition.healed and p > before]
        assert moved, f"{reader} did not move between the cut and the heal"
        assert moved[0] - partition.cut <= options.stall_bound
    assert all(r.longest_stall <= options.stall_bound for r in report.readers if r.bounded)

    # Healed, the writer went on by itself (a new incarnation), or exited fenced and
    # its supervisor started it again.
    said = [
        line.fields[0]
        for line in journal.read(tmp_path / f"{writer}.journal")
        if line.kind == "S" and line.t > partition.cut
    ]
    assert said[:1] == ["renewed"] or said[:2] == ["fenced", "started"], said
    assert report.renewed + report.faults.fenced_alive == 1
    print(
        f"{writer}: cut off {partition.cut - partition.hole:.1f} s, healed after"
        f" {partition.healed - partition.hole:.1f} s; "
        + ("went on as a new incarnation" if "renewed" in said else "exited fenced, restarted")
        + f"; stalls {[round(r.longest_stall, 2) for r in report.readers if r.bounded]}"
    )
