"""`plait demo` end to end, in its short mode: separate processes over the TCP hub,
simulated users, the Spark export; the demo checks itself and says so."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

import pace

pytestmark = pytest.mark.slow


async def test_the_demo_runs_and_its_checks_hold(server_dsn: str) -> None:
    """...and it tells how to look at its data (`plait status`/`tail` with `--schema`),
    which then works, and leaves no folder behind."""
    schema = f"plait_demo_{uuid.uuid4().hex[:8]}"  # not the default: tests run side by side
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "plait.cli", "demo", "--duration", "10", "--dsn", server_dsn,
        "--schema", schema,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        output, _ = await pace.wait(demo.communicate(), 300, "plait demo to run and end")
        text = output.decode()
        assert demo.returncode == 0, text
        _the_checks_held(text)
        folder = re.search(r"process logs in (\S+)", text)
        assert folder is not None, text
        assert not await asyncio.to_thread(Path(folder[1]).exists), "its folder stayed behind"
        assert f"plait status --dsn DSN --schema {schema}" in text
        assert f"plait tail events --dsn DSN --schema {schema}" in text
        plait = [sys.executable, "-m", "plait", "--dsn", server_dsn, "--schema", schema]
        shown = await asyncio.to_thread(
            subprocess.run, [*plait[:3], "status", *plait[3:]], capture_output=True, text=True
        )
        assert "events" in shown.stdout, shown.stdout + shown.stderr
        rows = await asyncio.to_thread(
            subprocess.run,
            [*plait[:3], "tail", "events", *plait[3:], "-n", "3"],
            capture_output=True,
            text=True,
        )
        assert rows.returncode == 0, rows.stderr
        assert len(rows.stdout.splitlines()) == 3
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _the_checks_held(text: str) -> None:
    delivered = re.search(r"rows delivered to every reader: (\d+) of (\d+)", text)
    assert delivered is not None, text
    assert delivered[1] == delivered[2]
    assert int(delivered[2]) > 100
    received = re.search(r"messages received by the syncing client: (\d+) of (\d+), 0 dup", text)
    assert received is not None, text
    assert received[1] == received[2]
    exported = re.search(r"rows in PostgreSQL: (\d+), rows in Parquet: (\d+)", text)
    assert exported is not None, text
    assert exported[1] == exported[2] == received[2]
