"""The checker survives its own faults (issue 18, finding 8): a fault that cannot be
injected is counted and retried, never an abort of the run.

Before: `pg_terminate` connected to PostgreSQL to find a writer's backends, and a
refused connection (`too many clients`, or the server down) raised out of the fault
schedule: the run ended with a traceback and no verdict."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from rich.console import Console

from plait.check.options import Options
from plait.check.plan import Plan
from plait.check.run import Checker, Report, _Proc
from plait.check.table import summary
from plait.ports import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def live_writer(tmp_path: Path) -> AsyncIterator[_Proc]:
    """A process the checker takes for a live writer (it only needs a target)."""
    refusing = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres?connect_timeout=2"
    plan = Plan(
        dsn=refusing, transport="tcp", run_dir=tmp_path, writers=("w0",), streams=1, fence_after=1.0
    )
    proc = _Proc("writer", "w0", plan)
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
    live_writer: _Proc,
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
    reader = _Proc("no-such-role", "spark", plan)  # exits at once: an unknown role
    await reader.spawn()
    assert not await reader.until("started", 30)
    why = await reader.why_not("started", 30)
    assert "spark did not say 'started': exited with 1" in why
    assert "KeyError: 'no-such-role'" in why
    assert str(tmp_path / "spark.log") in why
    checker = Checker(Options(seed=1))
    checker.plan, checker.readers = plan, [reader]
    assert checker._reader_deaths() == {"spark": "exited with 1: KeyError: 'no-such-role'"}
