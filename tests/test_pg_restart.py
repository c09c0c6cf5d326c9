"""PostgreSQL restarts and crashes heal without an operator (R-OP-5), for the readers
that follow the database and for the cache worker: each reconnects with backoff and
resumes, and none hangs. The checker's own processes are the readers, run against a
server the test owns: a fast restart (every backend ends with `AdminShutdown`), and a
kill -9 of the postmaster followed by a start.

Before: a database-only reader (`dblinear`) and the `linear` reader raised
`AdminShutdown` out of their loop, then never exited (a psycopg-pool worker swallowed
the shutdown's cancellation and waited forever), and the cache worker's serving task
died on its first failed load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pg_restarts import RestartablePostgres, Role, control, prepare_plan, targets
from plait.check.plan import DB_LINEAR, LINEAR, WORKER
from redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def pg(tmp_path: Path) -> AsyncIterator[RestartablePostgres]:
    base = tmp_path / "server"
    base.mkdir()
    base.chmod(0o755)  # the server's user (when run as root) must reach its data dir
    tmp_path.chmod(0o755)
    server = await asyncio.to_thread(RestartablePostgres, base / "pg")
    try:
        yield server
    finally:
        await asyncio.to_thread(server.close)


@pytest.mark.parametrize("outage", ["restart", "crash"])
async def test_readers_and_the_cache_worker_resume_after_postgresql_goes_away(
    outage: str, pg: RestartablePostgres, redis_server: RedisServer, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = await prepare_plan(pg.dsn, run_dir, redis_server.url)
    control(plan, phase="run")
    readers = {name: Role(name, name, plan) for name in (LINEAR, DB_LINEAR, WORKER)}
    writer = Role("writer", "w1", plan)
    everyone = [*readers.values(), writer]
    try:
        for reader in readers.values():
            await reader.start()
        await writer.start()
        await asyncio.sleep(1.0)  # rows and invalidations flow
        await asyncio.to_thread(pg.restart if outage == "restart" else pg.crash)
        back = time.time()
        # The writer commits again (it retries its failed transactions) ...
        deadline = time.monotonic() + 20
        while not any(line.kind == "C" and line.t > back for line in writer.journal()):
            assert time.monotonic() < deadline, (
                f"the writer committed nothing within 20 s of the {outage}:\n{writer.log_tail()}"
            )
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        control(plan, phase="idle")
        await writer.until("idle", 20)
        # ... and every reader reads what it committed after the outage.
        control(plan, phase="idle", targets=await targets(plan))
        for reader in readers.values():
            await reader.until("caught-up", 20)
        control(plan, phase="stop", targets=await targets(plan))
        for process in everyone:
            code = await process.exit_code(20)
            assert code == 0, f"{process.name} exited with {code}:\n{process.log_tail()}"
        worker = readers[WORKER].journal()
        served = [line.fields for line in worker if line.kind == "S" and line.fields[0] == "served"]
        assert served, f"the cache worker's serving task died:\n{readers[WORKER].log_tail()}"
        stale = [line.fields for line in worker if line.kind == "V"]
        assert not stale, f"the cache worker served stale values: {stale[:5]}"
    finally:
        for process in everyone:
            process.kill()
