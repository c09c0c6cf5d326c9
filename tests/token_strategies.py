"""Hypothesis strategies for `StreamToken`s."""

from __future__ import annotations

from hypothesis import strategies as st

from plait.core.tokens import StreamToken

# Few names and small numbers, so random tokens share writers and compare equal often.
SMALL_NAMES = st.sampled_from(["a", "b", "c", "d"])


@st.composite
def tokens(
    draw: st.DrawFn,
    names: st.SearchStrategy[str] = SMALL_NAMES,
    max_min: int = 6,
    max_ahead: int = 6,
) -> StreamToken:
    low = draw(st.integers(0, max_min))
    ahead = draw(st.dictionaries(names, st.integers(1, max_ahead), max_size=4))
    return StreamToken(low, {w: low + d for w, d in ahead.items()})
