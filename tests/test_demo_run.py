"""`plait demo` end to end, in its short mode: separate processes over the TCP hub,
simulated users, the Spark export; the demo checks itself and says so."""

from __future__ import annotations

import asyncio
import re
import sys

import pytest

pytestmark = pytest.mark.slow


async def test_the_demo_runs_and_its_checks_hold(server_dsn: str) -> None:
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "plait.cli", "demo", "--duration", "10", "--dsn", server_dsn,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(demo.communicate(), 300)
    text = output.decode()
    assert demo.returncode == 0, text
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
