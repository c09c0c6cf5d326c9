"""`Progress`: silent for quick work, then a line every so often and one at the end."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from plait.core.progress import Progress


def test_quick_work_says_nothing() -> None:
    progress = Progress("catching up events of w1", 100, 200, started=0.0)
    assert progress.step(150, 10, now=1.0) is None
    assert progress.step(200, 10, now=1.9) is None
    assert progress.done(now=1.95) is None


def test_long_work_reports_share_rows_and_time_then_the_end() -> None:
    progress = Progress("catching up events of w1", 100, 300, started=0.0, after=2.0, every=5.0)
    assert progress.step(150, 40, now=1.0) is None
    line = progress.step(200, 60, now=2.5)
    assert line == "catching up events of w1: 50% of IDs (100 of 200), 100 rows, 2.5 s"
    assert progress.step(250, 10, now=7.0) is None  # within 5 s of the last line
    assert progress.step(300, 10, now=7.5) == (
        "catching up events of w1: 100% of IDs (200 of 200), 120 rows, 7.5 s"
    )
    assert progress.done(now=8.0) == "catching up events of w1: done, 120 rows in 8.0 s"


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 50), st.floats(0, 3)), max_size=50))
def test_lines_are_spaced_and_shares_stay_in_range(steps: list[tuple[int, int, float]]) -> None:
    progress = Progress("w", 0, 1000, started=0.0, after=2.0, every=5.0)
    now, said = 0.0, []
    for at, rows, pause in steps:
        now += pause
        line = progress.step(at, rows, now)
        if line is not None:
            said.append(now)
            share = float(line.split(": ")[1].split("%")[0])
            assert 0 <= share <= 100
    if said:
        assert said[0] >= 2.0
        assert all(b - a >= 5.0 for a, b in itertools.pairwise(said))
    assert (progress.done(now) is None) == (not said)
