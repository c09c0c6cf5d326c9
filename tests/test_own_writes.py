"""The sender's record of its own completed writes, against a plain dict model (pure)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.core.own_writes import OwnWrites

ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.integers(1, 60), st.booleans(), st.integers(0, 2)),
        st.tuples(st.just("known"), st.integers(0, 60), st.integers(0, 60)),
        st.tuples(st.just("drop"), st.integers(0, 60)),
        st.tuples(st.just("unknown"), st.integers(0, 60), st.integers(0, 60)),
    ),
    max_size=60,
)


@given(ops)
def test_matches_a_model(steps: list[tuple[Any, ...]]) -> None:
    writes: OwnWrites[str] = OwnWrites()
    model: dict[int, list[str] | None] = {}
    unknown: set[int] = set()  # IDs in a range marked unknown, not sent yet
    for step in steps:
        if step[0] == "record":
            _, stream_id, known, count = step
            if stream_id in model:
                with pytest.raises(ValueError, match="twice"):
                    writes.record([stream_id], None)
                continue
            rows = [f"{stream_id}.{i}" for i in range(count)]
            writes.record(
                [stream_id], {stream_id: rows} if known and rows else {} if known else None
            )
            model[stream_id] = rows if known else None
        elif step[0] == "known":
            _, low, high = step
            window = sorted(i for i in model if low < i <= high)
            expected = (
                None
                if any(model[i] is None for i in window) or unknown & set(range(low + 1, high + 1))
                else [(i, model[i]) for i in window]
            )
            assert writes.known(low, high) == expected
        elif step[0] == "unknown":
            _, low, high = step
            writes.unknown(low, high)
            unknown |= set(range(low + 1, high + 1))
        else:
            _, upto = step
            writes.drop_upto(upto)
            model = {i: r for i, r in model.items() if i > upto}
            unknown = {i for i in unknown if i > upto}
        assert len(writes) == len(model)
