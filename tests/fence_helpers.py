"""Writer processes and a linear reader for the fencing tests (fence_roles.py is the
process; PgBouncer's tests run the same set-up through a pooler)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import pace
from plait import Database, MultiWriterIdGenerator
from plait.storage.incarnation import name_prefix

ROLE = Path(__file__).with_name("fence_roles.py")


async def spawn(dsn: str, name: str, config: Any = None) -> asyncio.subprocess.Process:
    args: dict[str, Any] = {"dsn": dsn, "name": name, "writers": ["w1", "w2"]}
    if config is not None:
        args["config"] = config
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROLE),
        json.dumps(args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    async with pace.within(30, "the writer process to say it started"):
        line = await process.stdout.readline()
    assert line == b"started\n", (line, await process.stderr.read() if process.stderr else b"")
    return process


class LinearReader:
    """Follows persisted-up-to, reading every row at or below it once."""

    def __init__(self, gen: MultiWriterIdGenerator) -> None:
        self.gen = gen
        self.linear = gen.get_current_token()
        self.seen: list[tuple[int, str]] = []

    async def catch_up(self) -> int:
        target = self.gen.get_current_token()
        while self.linear < target:
            rows, upto, _ = await self.gen.get_updates_since(None, self.linear, target, 500)
            self.seen.extend((r.stream_id, r.instance_name) for r in rows)
            self.linear = upto
        return self.linear

    async def until(self, position: int, within: float) -> float:
        """Seconds until the linear position reached `position`; a TimeoutError after
        `within` seconds at this machine's pace."""
        started = time.monotonic()
        try:
            async with pace.within(within, f"the linear position to reach {position}"):
                while await self.catch_up() < position:  # noqa: ASYNC110 - polls the database
                    await asyncio.sleep(0.02)
        except TimeoutError as late:
            raise TimeoutError(f"{late}; it is at {self.linear}") from None
        return time.monotonic() - started


async def committed(db: Database) -> list[tuple[int, str]]:
    async with db.connection() as conn:
        cursor = await conn.execute("SELECT stream_id, instance_name FROM events ORDER BY 1")
        return [(r[0], r[1]) for r in await cursor.fetchall()]


async def server_processes_gone(db: Database, writers: list[str], within: float) -> None:
    """Wait until no server process carries a name of the `writers`' registered runs,
    what a fence proves: a killed writer's COMMIT may still be landing after the
    process was reaped (the server finishes it after the link dropped), and only then is
    every row it will ever commit committed. `within` seconds at this machine's pace."""
    limit = pace.scaled(within)
    async with db.connection() as conn:
        cursor = await conn.execute(
            "SELECT DISTINCT epoch FROM stream_positions"
            " WHERE instance_name = ANY(%s) AND epoch IS NOT NULL",
            (writers,),
        )
        prefixes = [name_prefix(int(row[0])) for row in await cursor.fetchall()]
    started = time.monotonic()
    while True:
        async with db.connection() as conn:
            cursor = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE EXISTS (SELECT 1 FROM unnest(%s::text[]) p"
                " WHERE starts_with(application_name, p))",
                (prefixes,),
            )
            row = await cursor.fetchone()
        if row is not None and row[0] == 0:
            return
        if time.monotonic() - started > limit:
            raise TimeoutError(
                f"waited {limit:.1f} s for the server processes of {writers} to end after they"
                f" were killed; {row[0] if row else '?'} still alive"
            )
        await asyncio.sleep(0.05)


def stop(*processes: asyncio.subprocess.Process) -> None:
    for process in processes:
        if process.returncode is None:
            process.kill()
