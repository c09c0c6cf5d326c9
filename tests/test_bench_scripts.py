"""Every benchmark script still starts (a bench nobody can run measures nothing): its
imports resolve and its options parse. The measurements themselves are not tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import pace

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name not in {"common.py", "__init__.py"})


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_starts(script: Path) -> None:
    done = pace.run(
        [sys.executable, str(script), "--help"], 120, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"{script.name} --help failed:\n{done.stderr[-2000:]}"
    assert "usage" in done.stdout.lower()


def test_there_are_bench_scripts() -> None:
    assert len(SCRIPTS) >= 5
