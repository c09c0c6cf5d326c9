"""Every benchmark script still works (a bench nobody can run measures nothing).

By default each one only starts: its imports resolve and its options parse. With
`-m bench` (CI runs it), each runs for real at its smallest sizes (`--smoke`) against
the test database, and must print its figures as JSON lines, marked as smoke runs. The
measurements themselves are not tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import pace

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name not in {"common.py", "__init__.py"})
# A smoke run is seconds of work; Spark's start and a loaded machine stretch it.
SMOKE_TIMEOUT = 300


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_starts(script: Path) -> None:
    done = pace.run(
        [sys.executable, str(script), "--help"], 120, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"{script.name} --help failed:\n{done.stderr[-2000:]}"
    assert "usage" in done.stdout.lower()
    assert "--smoke" in done.stdout, f"{script.name} has no --smoke run"


# Also `slow`: an explicit -m replaces the default that leaves `bench` out, and the
# runs that pick `not slow` (CI's embedded-server pass, a quick local run) must skip it.
@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_runs_small(script: Path, server_dsn: str, redis_url: str) -> None:
    env = {**os.environ, "PLAIT_BENCH_DSN": server_dsn, "PLAIT_BENCH_REDIS": redis_url}
    done = pace.run(
        [sys.executable, str(script), "--smoke"],
        SMOKE_TIMEOUT,
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert done.returncode == 0, f"{script.name} --smoke failed:\n{done.stderr[-3000:]}"
    figures = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert figures, f"{script.name} --smoke printed no figure:\n{done.stderr[-2000:]}"
    assert all(figure.get("smoke") is True for figure in figures), figures


def test_there_are_bench_scripts() -> None:
    assert len(SCRIPTS) >= 5
