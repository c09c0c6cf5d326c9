"""A network that goes silent in the middle of a Spark read (SPEC §8, issue 19): the
task waiting for rows learns its connection is dead from the keepalives plait puts in
the reader's DSN, within `DatabaseTimeouts.dead_after`, fails, and Spark's retry reads
its rows once the network is back: every row once, no hang. Real processes and a real
cut (`spark_silent_kernel.py`: network namespaces and a veth pair); a proxy in between
would answer the keepalives itself."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import pace
from plait.storage.timeouts import DatabaseTimeouts
from test_partition import _can_cut_cables

DRIVER = Path(__file__).with_name("spark_silent_kernel.py")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not _can_cut_cables(), reason="needs root, network namespaces and veth")
def test_a_read_whose_network_goes_silent_fails_its_task_and_spark_reads_it_again() -> None:
    dead_after = DatabaseTimeouts().dead_after
    assert dead_after is not None
    down_for = dead_after + 4  # long enough for the keepalives to end the connection
    # The kernel's bounds at this machine's pace (it takes them as they are).
    args = {"start_within": pace.scaled(180), "down_for": down_for, "within": pace.scaled(240)}
    done = pace.run(
        ["unshare", "--net", sys.executable, str(DRIVER), json.dumps(args)],
        540,
        capture_output=True,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    lines = done.stdout.decode().splitlines()
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    assert lines, done.stderr.decode()[-4000:]
    result = json.loads(lines[-1])
    print(f"silent network: {result}")
    assert (result["rows"], result["distinct"], result["sum"]) == (
        result["written"],
        result["written"],
        result["written_sum"],
    )
    assert result["failed_tasks"] >= 1  # the silent connection ended a task; a retry read it
