"""Reconnect backoff (pure): grows to its cap, never resets before `up()`."""

from __future__ import annotations

from typing import TypedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.core.backoff import Backoff


@given(
    st.floats(0.001, 1.0),
    st.floats(1.0, 60.0),
    st.floats(1.0, 4.0),
    st.lists(st.sampled_from(["fail", "up"]), max_size=40),
)
def test_delays_grow_to_the_cap_and_start_over_only_when_up(
    initial: float, cap: float, factor: float, events: list[str]
) -> None:
    cap = max(cap, initial)
    backoff = Backoff(initial=initial, cap=cap, factor=factor, jitter=0.0)
    previous = 0.0
    for event in events:
        if event == "up":
            backoff.up()
            assert not backoff.failures_pending
            previous = 0.0
            continue
        delay = backoff.next_delay()
        assert backoff.failures_pending
        assert initial <= delay <= cap
        assert delay >= previous  # a failure (also during catch-up) never shortens it
        assert delay == initial if previous == 0.0 else delay == min(cap, previous * factor)
        previous = delay


def test_jitter_only_ever_shortens_and_stays_in_its_band() -> None:
    draws = iter([0.0, 1.0, 0.5])
    backoff = Backoff(initial=1.0, cap=8.0, factor=2.0, jitter=0.25, rand=lambda: next(draws))
    assert backoff.next_delay() == 1.0
    assert backoff.next_delay() == 1.5  # 2.0 scaled by 0.75
    assert backoff.next_delay() == 3.5  # 4.0 scaled by 0.875


def test_a_failing_catch_up_keeps_backing_off() -> None:
    backoff = Backoff(initial=0.1, cap=1.0, jitter=0.0)
    delays = [backoff.next_delay() for _ in range(6)]  # connects, fails during catch-up
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    backoff.up()
    assert backoff.next_delay() == 0.1


class Settings(TypedDict, total=False):
    initial: float
    cap: float
    factor: float
    jitter: float


@pytest.mark.parametrize(
    "kwargs", [{"initial": 0.0}, {"initial": 5.0, "cap": 1.0}, {"factor": 0.5}, {"jitter": 1.0}]
)
def test_nonsense_settings_are_refused(kwargs: Settings) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(**kwargs)
