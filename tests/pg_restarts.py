"""A PostgreSQL server a test owns and may restart, and the checker's processes run
against it as the orchestrator runs them (`python -m plait.check.roles ROLE NAME PLAN`).

`RestartablePostgres` (the checker's own, `plait.check.postgres`) is the embedded
server in a directory of the test's own, on a fixed port, so that every process
reconnects to the same address after a restart: `restart()` is a fast shutdown then a
start, `crash()` a kill -9 of the postmaster then a start.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

import pace
from plait.caches.invalidations import CACHES_STREAM
from plait.check.journal import Line, read
from plait.check.plan import Plan, write_control
from plait.check.postgres import RestartablePostgres
from plait.check.schema import create_tables, last_cache_rows

__all__ = ["RestartablePostgres", "Role", "control", "prepare_plan", "targets"]


async def prepare_plan(server_dsn: str, run_dir: Path, redis_url: str, **changes: Any) -> Plan:
    """The checker's schema in a fresh schema of `server_dsn`, and a plan on it (as
    `Checker._prepare` makes them): one writer `w1`, two streams, the Redis transport.
    No one fences (`fence_after` is long): fencing after a crash is not tested here."""
    async with await psycopg.AsyncConnection.connect(server_dsn, autocommit=True) as conn:
        await conn.execute('CREATE SCHEMA "check"')
    dsn = make_conninfo(server_dsn, options="-c search_path=check")
    plan = Plan(
        dsn=dsn,
        transport="redis",
        run_dir=run_dir,
        writers=("w1",),
        streams=2,
        fence_after=600.0,
        redis_url=redis_url,
        **changes,
    )
    await create_tables(plan)
    return plan


async def targets(plan: Plan) -> dict[str, Any]:
    """What the readers must reach: the linear position of each stream, and every
    writer's last row of the caches stream (as `check.schema.truth` computes them)."""
    async with await psycopg.AsyncConnection.connect(plan.dsn, autocommit=True) as conn:
        linear = {}
        for s in plan.stream_names:
            cur = await conn.execute(f"SELECT COALESCE(max(stream_id), 0) FROM {plan.table(s)}")
            row = await cur.fetchone()
            linear[s] = {"*": int(row[0]) if row else 0}
        caches = await last_cache_rows(conn)
    return {"linear": linear, "caches": {CACHES_STREAM: caches}}


class Role:
    """One checker process, its standard output watched for the words it says."""

    def __init__(self, role: str, name: str, plan: Plan) -> None:
        self.role, self.name, self.plan = role, name, plan
        self.log = plan.run_dir / f"{name}.log"
        self.said: set[str] = set()
        self.proc: asyncio.subprocess.Process | None = None
        self._listener: asyncio.Task[None] | None = None

    async def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "plait.check.roles",
                self.role,
                self.name,
                self.plan.to_json(),
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
            )
        self._listener = asyncio.create_task(self._listen())
        await self.until("started", 30)

    async def _listen(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.said.add(line.decode().strip())

    async def until(self, word: str, within: float) -> None:
        """Until the process said `word`, for `within` seconds at this machine's pace."""
        limit = pace.scaled(within)
        deadline = time.monotonic() + limit
        while word not in self.said:
            assert self.proc is not None
            if self.proc.returncode is not None:
                raise AssertionError(
                    f"{self.name} exited ({self.proc.returncode}) before saying {word!r}:\n"
                    f"{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.dump_tasks()
                raise AssertionError(
                    f"waited {limit:.1f} s for {self.name} to say {word!r}:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.05)

    async def exit_code(self, within: float) -> int:
        """The process's exit status once it ended; fails when it is still running
        after `within` seconds at this machine's pace (it hangs: its tasks are logged
        first)."""
        assert self.proc is not None
        try:
            code = await pace.wait(self.proc.wait(), within, f"{self.name} to end when told to")
        except TimeoutError as late:
            self.dump_tasks()
            await asyncio.sleep(1)
            self.kill()
            raise AssertionError(f"{late}; still running:\n{self.log_tail(60)}") from None
        if self._listener is not None:
            await self._listener
        return code

    def dump_tasks(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGUSR1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def journal(self) -> list[Line]:
        return list(read(self.plan.journal(self.name)))

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def control(plan: Plan, **value: Any) -> None:
    write_control(plan.control, value)
