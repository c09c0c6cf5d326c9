"""A Spark Python worker's row reads keep their ADBC connection only while its socket
shows it whole (`plait.spark.read_connections`): the ADBC driver held at 1.8 aborts the
process on a query sent over a connection the server has closed. The reads run in a
process of their own, as in a worker, so that an abort fails the test and not pytest."""

from __future__ import annotations

import json
import sys

from hypothesis import given
from hypothesis import strategies as st

import pace
from plait.spark import read_connections
from plait.spark.read_connections import new_socket, reusable

READS = r"""
import json, sys, time
import psycopg
from pyspark.sql.types import LongType, StructField, StructType
from plait.spark import read_connections
from plait.spark.task_reads import read_arrow

dsn, within = sys.argv[1], float(sys.argv[2])
read_connections.REUSE_WITHIN = within
PID = StructType([StructField("pid", LongType())])


def pid() -> int:
    batches = list(read_arrow(dsn, "SELECT pg_backend_pid()::int8 AS pid", PID))
    return int(batches[0].column(0)[0].as_py())


def terminate(pid: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        while conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
            time.sleep(0.01)  # gone: its error message and its end are on our socket


seen = {"first": pid(), "second": pid()}
terminate(seen["second"])
seen["after_terminate"] = pid()
try:
    list(read_arrow(dsn, "SELECT 1 / 0 AS pid", PID))
except Exception:
    pass
seen["after_failure"] = pid()
rows = read_arrow(dsn, "SELECT g::int8 AS pid FROM generate_series(1, 200000) g", PID)
next(rows)
rows.close()  # Spark stopping a read early (a limit)
seen["after_early_stop"] = pid()
print(json.dumps(seen))
"""


def _reads(dsn: str, reuse_within: float) -> dict[str, int]:
    done = pace.run(
        [sys.executable, "-c", READS, dsn, str(reuse_within)], 120, capture_output=True, text=True
    )
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    seen: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    return seen


def test_a_kept_connection_is_reused_only_while_whole(dsn: str) -> None:
    """Reused when nothing happened to it; not after the server ended it (no abort),
    nor after a read that failed or stopped early."""
    seen = _reads(dsn, reuse_within=3600)
    assert seen["second"] == seen["first"]  # kept
    assert seen["after_terminate"] != seen["second"]  # seen to be closed, not used
    assert seen["after_failure"] != seen["after_terminate"]
    assert seen["after_early_stop"] != seen["after_failure"]


def test_a_connection_idle_longer_than_reuse_within_is_not_reused(dsn: str) -> None:
    seen = _reads(dsn, reuse_within=0)
    assert len(set(seen.values())) == len(seen)


links = st.integers(1, 40).map(lambda n: f"socket:[{n}]") | st.sampled_from(
    ["pipe:[7]", "/dev/null", "anon_inode:[eventpoll]"]
)
tables = st.dictionaries(st.integers(0, 12), links, max_size=10)


@given(tables, tables)
def test_the_connection_socket_is_the_one_socket_that_appeared(
    before: dict[int, str], after: dict[int, str]
) -> None:
    appeared = {
        (fd, link)
        for fd, link in after.items()
        if link.startswith("socket:") and before.get(fd) != link
    }
    found = new_socket(before, after)
    if len(appeared) == 1:
        assert found == next(iter(appeared))
    else:
        assert found is None  # none, or which one is unknowable: not kept


@given(
    st.floats(0, 10, allow_nan=False),
    st.sampled_from(["socket:[1]", "socket:[2]", None]),
    st.booleans(),
)
def test_reuse_needs_recent_use_the_same_socket_and_a_quiet_peek(
    held_for: float, link_now: str | None, quiet: bool
) -> None:
    expected = held_for < read_connections.REUSE_WITHIN and link_now == "socket:[1]" and quiet
    assert reusable(held_for, link_now, "socket:[1]", lambda: quiet) == expected
