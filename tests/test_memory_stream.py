"""In-memory streams against a model: paging through (from, to] yields the latest row of
every key written in that range, once, in token order; a read from before the writer's
start is a reset carrying its whole state (pure, no I/O)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.streams.memory import MemoryStream

keys = st.sampled_from("abcdef")


def page_through(
    stream: MemoryStream, low: int, high: int, limit: int
) -> tuple[list[tuple[int, Any]], bool]:
    rows: list[tuple[int, Any]] = []
    reset, first = False, True
    while low < high:
        page = stream.read(low, high, limit)
        assert page.upto > low or not page.limited
        reset = reset or (page.reset and first)
        assert not page.reset or first  # only the first page can be a reset
        rows.extend(page.rows)
        first = False
        low = page.upto
    return rows, reset


@given(st.lists(keys, max_size=40), st.data())
def test_paging_yields_the_latest_row_of_each_key_once(
    writes: list[str], data: st.DataObject
) -> None:
    stream = MemoryStream("typing", clock=lambda: 0, start=1000)
    history = [(stream.write(key, f"{key}{i}"), key) for i, key in enumerate(writes)]
    end = stream.position
    low = data.draw(st.integers(1000, end), label="from")
    limit = data.draw(st.integers(1, 6), label="limit")
    rows, reset = page_through(stream, low, end, limit)
    latest = {key: token for token, key in history}
    expected = sorted((t, f"{k}{t - 1001}") for k, t in latest.items() if t > low)
    assert rows == expected
    assert not reset


def test_a_read_from_before_the_start_is_a_reset_with_the_whole_state() -> None:
    stream = MemoryStream("typing", clock=lambda: 0, start=5000)
    stream.write("room1", ["alice"])
    stream.write("room2", ["bob"])
    stream.write("room1", [])
    page = stream.read(1234, stream.position, 10)
    assert page.reset
    assert not page.limited
    assert page.rows == [(5002, ["bob"]), (5003, [])]
    assert stream.get("room1") == []
    assert stream.get("nope") is None


def test_tokens_follow_the_clock_so_a_restart_continues_above_the_last_run() -> None:
    now = [100]
    before = MemoryStream("typing", clock=lambda: now[0])
    assert [before.write("k", i) for i in range(3)] == [101, 102, 103]  # faster than the clock
    now[0] = 500
    assert before.write("k", 3) == 500  # idle for a while: back on the clock
    now[0] = 501  # restart
    after = MemoryStream("typing", clock=lambda: now[0])
    assert after.start > before.position
    assert MemoryStream("typing").start > 1_700_000_000 * 10**6  # real clock, microseconds
    with pytest.raises(ValueError, match="positive"):
        MemoryStream("typing", start=-1)
