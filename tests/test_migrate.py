"""`plait migrate`: a line per step on a fresh schema, nothing to do the second time, and
a word while another process holds the migration lock."""

from __future__ import annotations

import asyncio

import psycopg
from click.testing import CliRunner

from plait.cli import main
from plait.storage.migrations import LATEST, MIGRATION_LOCK, MIGRATIONS


def migrate(dsn: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, ["migrate", "--dsn", dsn])
    return result.exit_code, result.stdout.splitlines()


async def test_migrate_reports_each_step_then_nothing_to_do(dsn: str) -> None:
    code, lines = await asyncio.to_thread(migrate, dsn)
    assert code == 0, lines
    assert lines[0] == f"plait schema is at version 0; applying {len(MIGRATIONS)} migration(s)"
    for step, (version, description, _) in enumerate(MIGRATIONS, 1):
        assert lines[step].startswith(
            f"[{step}/{len(MIGRATIONS)}] migration {version}: {description} ("
        )
    assert lines[-1] == f"plait schema is now at version {LATEST}"
    code, lines = await asyncio.to_thread(migrate, dsn)
    assert (code, lines) == (0, [f"plait schema is at version {LATEST}, the latest: nothing to do"])


async def test_migrate_says_when_it_waits_for_another_migration(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as holder:
        await holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
        running = asyncio.create_task(asyncio.to_thread(migrate, dsn))
        waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        for _ in range(3000):  # until the migration waits for the lock (60 s at most)
            row = await (await holder.execute(waiting)).fetchone()
            if running.done() or (row is not None and row[0]):
                break
            await asyncio.sleep(0.02)
        assert not running.done(), await running  # waiting for the lock
        await holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))
    code, lines = await running
    assert code == 0, lines
    assert lines[0] == "another process is migrating plait's schema; waiting for it"
    assert lines[-1] == f"plait schema is now at version {LATEST}"
