"""The log throttle, exhaustively over random event times (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from plait.core.throttle import Throttle


@given(
    events=st.lists(
        st.tuples(st.sampled_from("abc"), st.floats(0, 5, allow_nan=False)), max_size=60
    ),
    interval=st.floats(0.01, 2),
)
def test_one_pass_per_interval_and_every_event_counted(
    events: list[tuple[str, float]], interval: float
) -> None:
    throttle = Throttle(interval)
    last_pass: dict[str, float] = {}
    pending: dict[str, int] = {}
    for key, now in sorted(events, key=lambda e: e[1]):
        result = throttle.allow(key, now)
        if result is None:
            assert key in last_pass
            assert now - last_pass[key] < interval
            pending[key] = pending.get(key, 0) + 1
        else:
            assert key not in last_pass or now - last_pass[key] >= interval
            assert result == pending.pop(key, 0)  # every held-back event is reported
            last_pass[key] = now


def test_keys_are_bounded() -> None:
    throttle = Throttle(10.0, max_keys=3)
    for n in range(100):
        assert throttle.allow(n, 0.0) == 0
    assert len(throttle._keys) == 3
    assert throttle.allow(99, 1.0) is None  # recent keys are kept
    assert throttle.allow(0, 1.0) == 0  # the oldest were forgotten
