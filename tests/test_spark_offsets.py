"""Spark offsets and the ranges they plan, without Spark or I/O."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.core.tokens import StreamToken
from plait.errors import TokenParseError
from plait.spark import offsets
from plait.spark.offsets import WriterRange

WRITERS = ["a", "b", "c"]


@st.composite
def tokens(draw: st.DrawFn, low: int = 0) -> StreamToken:
    minimum = draw(st.integers(low, low + 50))
    ahead = draw(st.dictionaries(st.sampled_from(WRITERS), st.integers(1, 30)))
    return StreamToken(minimum, {w: minimum + d for w, d in ahead.items()})


@st.composite
def pairs(draw: st.DrawFn) -> tuple[StreamToken, StreamToken]:
    start = draw(tokens())
    latest = start.copy_and_advance(draw(tokens(low=0)))
    return start, latest


def covered(rs: list[WriterRange], writer: str) -> set[int]:
    """IDs of `writer` the ranges read."""
    out: set[int] = set()
    for r in rs:
        if r.writer == writer or (r.writer is None and writer not in r.others_than):
            out |= set(range(r.low + 1, r.high + 1))
    return out


@given(pairs(), st.sampled_from([*WRITERS, "late"]))
def test_ranges_read_each_writers_ids_between_the_offsets_once(
    pair: tuple[StreamToken, StreamToken], writer: str
) -> None:
    start, end = pair
    rs = offsets.ranges(start, end)
    assert covered(rs, writer) == set(range(start.get(writer) + 1, end.get(writer) + 1))
    # No writer is read by two ranges.
    for r in rs:
        for other in rs:
            if r is not other and r.writer is not None:
                assert other.writer != r.writer


@given(pairs(), st.integers(1, 7))
def test_slices_read_each_writers_ids_once_and_stay_within_their_span(
    pair: tuple[StreamToken, StreamToken], max_ids: int
) -> None:
    rs = offsets.ranges(*pair)
    pieces = offsets.slices(rs, max_ids)
    assert all(0 < p.high - p.low <= max_ids for p in pieces)
    # Slices of one stretch (each touching the next) are of equal size, give or take one.
    groups: list[list[int]] = []
    for before, p in zip([None, *pieces], pieces, strict=False):
        if before is None or before.high != p.low:
            groups.append([])
        groups[-1].append(p.high - p.low)
    assert all(max(g) - min(g) <= 1 for g in groups)
    for p in pieces:
        assert p.ranges, "a slice with nothing to read"
        assert all(p.low <= r.low < r.high <= p.high for r in p.ranges)
    # Slices do not overlap: each stretch of the table is scanned by one task.
    bounds = sorted((p.low, p.high) for p in pieces)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(bounds))
    for writer in [*WRITERS, "late"]:
        read = [covered(list(p.ranges), writer) for p in pieces]
        assert set().union(*read) == covered(rs, writer)
        assert sum(map(len, read)) == len(covered(rs, writer))  # no ID twice


@given(pairs(), st.integers(1, 7))
def test_by_writer_gives_each_writer_range_its_own_pieces(
    pair: tuple[StreamToken, StreamToken], max_ids: int
) -> None:
    rs = offsets.ranges(*pair)
    pieces = offsets.by_writer(rs, max_ids)
    for p in pieces:
        assert len(p.ranges) == 1
        assert (p.ranges[0].low, p.ranges[0].high) == (p.low, p.high)
        assert 0 < p.high - p.low <= max_ids
    for r in rs:  # a range's pieces tile it, in order, of equal size give or take one
        mine = [p for p in pieces if p.ranges[0].writer == r.writer]
        assert (mine[0].low, mine[-1].high) == (r.low, r.high)
        assert all(a.high == b.low for a, b in itertools.pairwise(mine))
        assert max(p.high - p.low for p in mine) - min(p.high - p.low for p in mine) <= 1
    for writer in [*WRITERS, "late"]:
        read = [covered(list(p.ranges), writer) for p in pieces]
        assert set().union(*read) == covered(rs, writer)
        assert sum(map(len, read)) == len(covered(rs, writer))  # no ID twice


@given(pairs(), st.integers(1, 7), st.sampled_from([*WRITERS, "late"]))
def test_a_slice_reads_everyone_only_when_every_writer_spans_it(
    pair: tuple[StreamToken, StreamToken], max_ids: int, writer: str
) -> None:
    rs = offsets.ranges(*pair)
    for p in offsets.slices(rs, max_ids):
        if p.everyone:
            assert covered(list(p.ranges), writer) == set(range(p.low + 1, p.high + 1))
    for p in offsets.by_writer(rs, max_ids):  # one range each: everyone only if it is
        assert p.everyone == (p.ranges[0].writer is None and not p.ranges[0].others_than)


def test_interleaved_writers_share_slices() -> None:
    start, end = StreamToken(0), StreamToken(100, {"a": 250})
    pieces = offsets.slices(offsets.ranges(start, end), 100)
    assert [(p.low, p.high) for p in pieces] == [(0, 83), (83, 166), (166, 250)]  # equal
    assert pieces[0].everyone  # "a" and everyone else, all of (0, 83]
    assert pieces[1].ranges == (WriterRange("a", 83, 166), WriterRange(None, 83, 100, ("a",)))
    assert not pieces[1].everyone
    assert pieces[2].ranges == (WriterRange("a", 166, 250),)
    # Ranges far apart are not bridged by a slice over the IDs between them.
    far = offsets.slices([WriterRange("a", 0, 10), WriterRange("b", 1000, 1010)], 10_000)
    assert [(p.low, p.high) for p in far] == [(0, 10), (1000, 1010)]


@given(pairs(), st.integers(0, 120))
def test_a_read_limit_cuts_at_the_cutoff_without_going_back(
    pair: tuple[StreamToken, StreamToken], cutoff: int
) -> None:
    start, latest = pair
    cut = offsets.limited(start, latest, cutoff)
    for writer in [*WRITERS, "late"]:
        position = cut.get(writer)
        assert start.get(writer) <= position <= latest.get(writer)
        assert position <= max(cutoff, start.get(writer))
        if latest.get(writer) <= cutoff:
            assert position == latest.get(writer)  # nothing held back below the cutoff


@given(tokens())
def test_offsets_round_trip_through_their_canonical_json(token: StreamToken) -> None:
    text = offsets.to_json(token)
    assert "\n" not in text
    assert " " not in text
    assert offsets.from_json(text) == token
    assert offsets.from_json(token.to_json_dict()) == token


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{", "not valid JSON"),
        ('{"min": -1}', "non-negative"),
        ('{"min": 3, "writers": {"a": 2}}', "not ahead of min"),
        ('{"min": 3, "extra": 1}', "unknown keys"),
        ("[1]", "must be an object"),
    ],
)
def test_malformed_offsets_are_refused_with_the_reason(bad: str, reason: str) -> None:
    with pytest.raises(TokenParseError, match=reason):
        offsets.from_json(bad)


def test_a_writer_first_seen_later_is_read_from_the_previous_min() -> None:
    start = StreamToken(10, {"a": 15})
    end = StreamToken(12, {"a": 20, "new": 30})
    rs = offsets.ranges(start, end)
    assert WriterRange("new", 10, 30) in rs
    assert WriterRange("a", 15, 20) in rs
    assert WriterRange(None, 10, 12, ("a", "new")) in rs
