"""Spark offsets and the ranges they plan, without Spark: pure, then (at the end) the
checks that need the stream's database, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql.streaming.datasource import ReadAllAvailable

import pace
from plait import Database
from plait.cli import main
from plait.core import offsets
from plait.core.offsets import WriterRange
from plait.core.tokens import StreamToken, decode_text
from plait.errors import ConfigError, TokenParseError
from plait.spark import kept, options, streaming
from plait.spark.plan import Plan
from plait.spark.schema import infer
from stream_helpers import create_generator, create_table

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


@given(pairs(), st.lists(st.sampled_from([*WRITERS, "late"]), unique=True))
def test_rows_behind_are_counted_per_writer_over_exactly_its_ids(
    pair: tuple[StreamToken, StreamToken], known: list[str]
) -> None:
    """`per_writer` gives each writer of the stream's list a range of its own with
    exactly the IDs the offsets' ranges read for it, once; writers outside the list are
    counted only where a range excludes no one (else the count walks the whole range)."""
    end, latest = pair
    rs = offsets.per_writer(offsets.ranges(end, latest), known)
    for writer in known:
        assert covered(rs, writer) == set(range(end.get(writer) + 1, latest.get(writer) + 1))
        assert len([r for r in rs if r.writer == writer]) <= 1
    assert all(r.writer is not None or not r.others_than for r in rs)
    counts = [r.high - r.low for r in rs]  # as if every ID were a row
    behind = offsets.rows_behind(known, rs, counts)
    assert set(known) <= set(behind)
    assert sum(behind.values()) == sum(counts)
    for writer in known:
        assert behind[writer] == len(covered(rs, writer))


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


identities = st.builds(
    offsets.Identity,
    st.sampled_from(["events", "events2"]),
    st.one_of(st.none(), st.sampled_from(["u1", "u2"])),
)


@given(tokens(), identities)
def test_an_offset_names_what_it_is_an_offset_of_and_round_trips(
    token: StreamToken, identity: offsets.Identity
) -> None:
    value = offsets.offset(token, identity)
    text = json.dumps(value)
    assert offsets.parse(text) == (token, identity)
    assert offsets.parse(value) == (token, identity)
    assert offsets.from_json(text) == token
    assert offsets.foreign(identity, identity) is None
    # A token a user wrote, or an offset of an older plait, names nothing: not refused.
    assert offsets.parse(token.to_json_dict()) == (token, None)
    assert offsets.foreign(None, identity) is None


@given(identities, identities)
def test_an_offset_of_another_stream_or_database_is_foreign(
    found: offsets.Identity, expected: offsets.Identity
) -> None:
    why = offsets.foreign(found, expected)
    if found.uid is not None and expected.uid is not None:
        assert (why is None) == (found.uid == expected.uid)  # the uid decides
    else:
        assert (why is None) == (found.stream == expected.stream)  # else the name
    if why is not None:
        assert f"it is an offset of {found}" in why
        assert f"not of {expected}" in why
        assert ("of another database" in why) == (found.stream == expected.stream)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ('{"min": 1, "stream": ""}', "must be a stream's name"),
        ('{"min": 1, "stream": 5}', "must be a stream's name"),
        ('{"min": 1, "stream": "s", "uid": 7}', "must be a stream's uid"),
        ('{"min": 1, "uid": "u"}', 'a "uid" but no "stream"'),
        ('{"min": 1, "stream": "s", "other": 1}', "unknown keys"),
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


# -- Unbounded offsets (issue 18, finding 7) ---------------------------------------------
# An offset is outside input: a startingToken, or a checkpoint's offset from another
# database. Values past PostgreSQL's BIGINT are refused when parsed; positions above the
# stream's sequence head and writers the stream does not have, before any planning; and
# planning is bounded whatever the offsets say.

BIGINT_MAX = 2**63 - 1
NOT_INTEGERS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.text(max_size=5),
    st.none(),
    st.lists(st.integers(0, 5), max_size=2),
)


@given(st.integers(min_value=BIGINT_MAX + 1), st.booleans())
def test_offsets_past_bigint_are_refused_when_parsed(big: int, as_writer: bool) -> None:
    value = {"min": 0, "writers": {"w1": big}} if as_writer else {"min": big}
    with pytest.raises(TokenParseError, match="BIGINT"):
        offsets.from_json(value)
    with pytest.raises(TokenParseError, match="BIGINT"):
        offsets.from_json(json.dumps(value))


@given(st.integers(min_value=BIGINT_MAX + 1, max_value=10**19 - 1))
def test_text_tokens_past_bigint_are_refused_when_parsed(big: int) -> None:
    for text in (f"s{big}", f"m{big}", f"m0~1.{big}"):
        with pytest.raises(TokenParseError, match="BIGINT"):
            decode_text(text)


@given(NOT_INTEGERS, st.booleans())
def test_offsets_of_anything_but_integers_are_refused_when_parsed(
    value: object, as_writer: bool
) -> None:
    offset = {"min": 0, "writers": {"w1": value}} if as_writer else {"min": value}
    with pytest.raises(TokenParseError):
        offsets.from_json(offset)


@given(st.integers(0, BIGINT_MAX))
def test_every_bigint_position_parses(position: int) -> None:
    assert offsets.from_json({"min": position}).min == position
    assert decode_text(f"s{position}") == (position, {})


@given(tokens(), st.integers(0, 120), st.sets(st.sampled_from(WRITERS)))
def test_an_offset_is_refused_exactly_when_above_the_head_or_naming_an_unknown_writer(
    token: StreamToken, head: int, known: set[str]
) -> None:
    reason = offsets.refusal(token, head, known)
    fits = token.max <= head and set(token.writers) <= known
    assert (reason is None) == fits
    if token.max > head:  # the first problem named is the one that rules out the rest
        assert reason is not None
        assert f"sequence head {head}" in reason
    elif not fits:
        assert reason is not None
        unknown = sorted(set(token.writers) - known)
        assert repr(unknown[0]) in reason
        assert "not a writer of" in reason


def test_a_refusal_says_which_writer_or_min_is_above_the_head() -> None:
    reason = offsets.refusal(StreamToken(3, {"w1": 10**12}), 407, {"w1"})
    assert reason == (
        "it puts writer 'w1' at 1000000000000, above the stream's sequence head 407 "
        "(the largest ID the stream has handed out)"
    )
    reason = offsets.refusal(StreamToken(10**12), 407, {"w1"})
    assert reason is not None
    assert reason.startswith("its min 1000000000000 is above")
    reason = offsets.refusal(StreamToken(3, {"ghost": 5}), 407, {"w1", "w2"})
    assert reason == "it names writer 'ghost', which is not a writer of the stream (['w1', 'w2'])"


@st.composite
def wide_ranges(draw: st.DrawFn) -> list[WriterRange]:
    """Ranges anywhere in the BIGINT space, some of them huge."""
    out = []
    for writer in draw(st.lists(st.sampled_from([*WRITERS, None]), max_size=5, unique=True)):
        low = draw(st.integers(0, BIGINT_MAX - 1))
        high = draw(st.integers(low + 1, BIGINT_MAX))
        others = tuple(w for w in WRITERS if w != writer) if writer is None else ()
        out.append(WriterRange(writer, low, high, others))
    return out


@given(wide_ranges(), st.integers(1, 10**6), st.integers(1, 50), st.booleans())
def test_planning_is_bounded_however_wide_the_ranges(
    rs: list[WriterRange], max_ids: int, max_slices: int, per_writer: bool
) -> None:
    cut = offsets.by_writer if per_writer else offsets.slices
    pieces = cut(rs, max_ids, max_slices=max_slices)
    assert len(pieces) <= max(max_slices, len(rs))
    # Still a tiling: each range's IDs, clipped to the pieces, add up to exactly the range
    # (counted, not enumerated: the ranges are up to 2^63 IDs wide).
    for r in rs:
        parts = sorted(
            (p.low, p.high)
            for piece in pieces
            for p in piece.ranges
            if (p.writer, p.others_than) == (r.writer, r.others_than)
        )
        assert parts[0][0] == r.low
        assert parts[-1][1] == r.high
        assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
    if not per_writer:  # no stretch read twice
        bounds = sorted((p.low, p.high) for p in pieces)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(bounds))


def test_pieces_keep_their_size_when_under_the_cap() -> None:
    rs = [WriterRange("a", 0, 1000)]
    assert len(offsets.slices(rs, 10, max_slices=100)) == 100
    assert len(offsets.slices(rs, 10, max_slices=50)) == 50  # wider, not more
    assert len(offsets.by_writer(rs, 10, max_slices=50)) == 50


# The report's process grew to 23.5 GB cutting (0, 2^63 - 1] into slices: run it where
# it cannot take the machine with it, under a 2 GB address-space limit.
_PLAN_HUGE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from plait.core.tokens import StreamToken, decode_text
from plait.core import offsets
rs = offsets.ranges(StreamToken(0), StreamToken(2**63 - 2, {"w1": 2**63 - 1}))
print(len(offsets.slices(rs, 250_000)), len(offsets.by_writer(rs, 250_000)))
"""


def test_planning_a_range_up_to_the_bigint_max_stays_small() -> None:
    done = pace.run([sys.executable, "-c", _PLAN_HUGE], 60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    planned = [int(n) for n in done.stdout.split()]
    assert all(n <= offsets.MAX_SLICES for n in planned), planned


# -- On a real PostgreSQL, without Spark: the sequence head and the stream's writers -----


async def _stream_with_rows(db: Database, **per_writer: int) -> None:
    """Stream `events` written by w1 and w2 (`per_writer` rows each), positions flushed."""
    await create_table(db)
    for name, count in per_writer.items():
        gen = await create_generator(db, ["w1", "w2"], name)
        try:
            await gen.insert(
                "INSERT INTO events (stream_id, instance_name, payload)"
                " SELECT {id}, %s, 'row' FROM generate_series(1, %s) RETURNING stream_id",
                (name, count),
            )
            await gen.flush_position()
        finally:
            await gen.close()


@pytest.fixture
def load_plan() -> Iterator[Callable[[str], Plan]]:
    """Loads stream `events`' plan on the connection this process keeps for the DSN (as
    Spark's driver does), closed when the test ends."""
    loaded: list[str] = []

    def load(dsn: str) -> Plan:
        loaded.append(dsn)
        return Plan.load(options.Options.parse({"dsn": dsn, "stream": "events"}))

    yield load
    for dsn in loaded:
        kept.Kept(dsn).forget()


async def test_tokens_above_the_sequence_head_or_of_writers_the_stream_lacks_are_refused(
    db: Database, load_plan: Callable[[str], Plan]
) -> None:
    await _stream_with_rows(db, w1=3, w2=4)  # IDs 2..8: the head is 8
    plan = await asyncio.to_thread(load_plan, db.dsn)
    for bad, reason in [
        ('{"min": 1000}', "its min 1000 is above the stream's sequence head 8"),
        ('{"min": 2, "writers": {"w1": 9}}', "writer 'w1' at 9, above the stream's sequence"),
        ("s1000", "its min 1000 is above"),
        ('{"min": 0, "writers": {"ghost": 3}}', "writer 'ghost', which is not a writer of"),
        ('{"min": 1e30}', "must be a non-negative integer"),
        (f'{{"min": {10**30}}}', "BIGINT"),
        # An offset of another stream (as a progress line prints it), pasted as a token.
        ('{"min": 2, "stream": "events2", "uid": "u2"}', "it is an offset of stream 'events2'"),
    ]:
        with pytest.raises(ConfigError) as caught:
            await asyncio.to_thread(plan.token, bad, "startingToken")
        message = str(caught.value)
        assert message.startswith(f"plait source: bad startingToken {bad!r}: "), message
        assert reason in message
        if "above" in reason:  # and what to do about it
            assert "another database or deployment" in message
            assert "earliest, latest or a token" in message
    # Up to the head, and only the stream's writers: fine.
    token = await asyncio.to_thread(plan.token, '{"min": 2, "writers": {"w2": 8}}', "startToken")
    assert token == StreamToken(2, {"w2": 8})
    own = json.dumps(plan.offset(token))  # the stream's own offset, naming it: fine
    assert await asyncio.to_thread(plan.token, own, "startToken") == token


async def test_a_writer_removed_from_the_stream_is_still_known_by_its_rows(
    db: Database, load_plan: Callable[[str], Plan]
) -> None:
    await _stream_with_rows(db, w1=3, w2=4)
    gen = await create_generator(db, ["w1"], "w1")  # w2 leaves the stream's writers
    await gen.close()
    plan = await asyncio.to_thread(load_plan, db.dsn)
    assert list(plan.spec.writers) == ["w1"]
    # A checkpoint made before the change may still name w2: its rows say it was a writer.
    token = await asyncio.to_thread(plan.token, '{"min": 1, "writers": {"w2": 8}}', "startToken")
    assert token.get("w2") == 8
    with pytest.raises(ConfigError, match="'w3', which is not a writer of the stream"):
        await asyncio.to_thread(plan.token, '{"min": 1, "writers": {"w3": 8}}', "startToken")


async def test_a_checkpoint_offset_above_the_head_is_refused_before_any_planning(
    db: Database, load_plan: Callable[[str], Plan]
) -> None:
    """A checkpoint of another database: Spark hands its offsets back to `latestOffset`
    (the next batch's start) and, on a restart, to `partitions` (the batch it had
    planned). Both refuse it, and say what to do, before cutting anything into slices."""
    await _stream_with_rows(db, w1=3, w2=4)
    plan = await asyncio.to_thread(load_plan, db.dsn)
    reader = streaming.StreamReader(plan, infer(list(plan.columns)))
    try:
        # 10^9 IDs would plan 4,000 slices (a checkpoint up to 2^63 - 1, 3.7e13 of them).
        far = {"min": 10**9, "writers": {}}
        with pytest.raises(ConfigError) as caught:
            await asyncio.to_thread(reader.partitions, {"min": 0, "writers": {}}, far)
        message = str(caught.value)
        assert "checkpoint" in message
        assert "its min 1000000000 is above the stream's sequence head 8" in message
        assert "delete the checkpoint" in message
        for start in (far, {"min": 10**30, "writers": {}}, {"min": 2, "writers": {"nobody": 5}}):
            with pytest.raises(ConfigError, match="checkpoint"):
                await asyncio.to_thread(reader.latestOffset, start, ReadAllAvailable())
        # The stream's own offsets still plan and move on.
        end = await asyncio.to_thread(reader.latestOffset, {"min": 0}, ReadAllAvailable())
        uid = plan.identity.uid
        assert uid is not None
        assert end == {"min": 4, "writers": {"w2": 8}, "stream": "events", "uid": uid}
        assert await asyncio.to_thread(reader.partitions, {"min": 0, "writers": {}}, end)
        # An offset of another stream (or of this name in another database) is refused
        # by what it names, wherever it is.
        for other in ({"stream": "events2", "uid": "u2"}, {"stream": "events", "uid": "u3"}):
            with pytest.raises(ConfigError, match="it is an offset of stream") as caught:
                await asyncio.to_thread(reader.latestOffset, {**end, **other}, ReadAllAvailable())
            assert f"not of stream 'events' (uid {uid})" in str(caught.value)
    finally:
        reader.stop()


async def test_positions_stored_above_the_head_are_refused_not_read_up_to(
    db: Database, load_plan: Callable[[str], Plan]
) -> None:
    """A `stream_positions` row past the sequence head (written by a rogue or a restored
    database) is not an offset to read up to: the source says what is wrong."""
    await _stream_with_rows(db, w1=3, w2=4)
    async with db.connection() as conn:
        await conn.execute(
            "UPDATE stream_positions SET stream_id = 1000000000 WHERE instance_name = 'w1'"
        )
    plan = await asyncio.to_thread(load_plan, db.dsn)
    with pytest.raises(ConfigError) as caught:
        await asyncio.to_thread(plan.token, "latest", "endToken")
    message = str(caught.value)
    assert "stream_positions records writer 'w1' at 1000000000" in message
    assert "sequence head 8" in message
    reader = streaming.StreamReader(plan, infer(list(plan.columns)))
    try:
        with pytest.raises(ConfigError, match="stream_positions records writer 'w1'"):
            await asyncio.to_thread(reader.latestOffset, {"min": 0}, ReadAllAvailable())
    finally:
        reader.stop()


# -- The CLI: the same checks, worded with the flag's name --------------------------------


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


async def test_the_cli_refuses_tokens_above_the_head_naming_its_flag(
    db: Database, tmp_path: Path
) -> None:
    await _stream_with_rows(db, w1=3, w2=4)
    for bad in ('{"min": 1000}', "s99999999999999999999", "s9999999999999999999"):
        result = await asyncio.to_thread(_cli, "tail", "events", "--dsn", db.dsn, "--from", bad)
        assert result.exit_code == 2, result.output
        assert "Invalid value for '--from'" in result.output
        assert "startingToken" not in result.output
    result = await asyncio.to_thread(
        _cli,
        *("export", "--dsn", db.dsn, "--stream", "events", "--once"),
        *("--starting-token", '{"min": 0, "writers": {"w1": 1000}}'),
        *("--checkpoint", str(tmp_path / "checkpoint"), "--path", str(tmp_path / "out")),
    )
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--starting-token'" in result.output
    assert "writer 'w1' at 1000, above the stream's sequence head 8" in result.output
    assert "startingToken" not in result.output
    assert not (tmp_path / "checkpoint").exists()  # refused before Spark started


async def test_a_stream_without_its_sequence_says_so(
    db: Database, load_plan: Callable[[str], Plan]
) -> None:
    await _stream_with_rows(db, w1=3)
    plan = await asyncio.to_thread(load_plan, db.dsn)
    async with db.connection() as conn:
        await conn.execute("DROP SEQUENCE events_seq")
    for value in ('{"min": 2}', "latest"):
        with pytest.raises(ConfigError, match="has no sequence 'events_seq' in this database"):
            await asyncio.to_thread(plan.token, value, "startToken")


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("startingOffsets", "startingToken"),  # Kafka's names
        ("maxOffsetsPerTrigger", "maxRowsPerTrigger"),
        ("endingOffsets", "endToken"),
        ("url", "dsn"),  # JDBC's
        ("startToken ", "startToken"),
        ("maxRows", "maxRowsPerTrigger"),
        ("strean", "stream"),
        ("maxIdsPerPartion", "maxIdsPerPartition"),
        ("path", None),
    ],
)
def test_unknown_source_options_are_refused_by_name(key: str, meant: str | None) -> None:
    """A misspelt option (Kafka's `startingOffsets` for `startingToken`) would otherwise
    be ignored, and the read start from the default: SPEC R-SP-4 makes it an error,
    which names the option most likely meant."""
    with pytest.raises(ConfigError) as caught:
        options.Options.parse({"dsn": "postgresql:///x", "stream": "events", key: "latest"})
    message = str(caught.value)
    hint = f" (did you mean {meant!r}?)" if meant else ""
    assert message.startswith(f"plait source: unknown option {key!r}{hint}; the options are ")
    assert "startingToken" in message


@given(
    now=st.floats(0, 1e6),
    last=st.none() | st.floats(0, 1e6),
    delay=st.floats(0.001, 1e4),
    enough=st.booleans(),
)
def test_a_trigger_holds_back_only_as_the_kafka_source_would(
    now: float, last: float | None, delay: float, enough: bool
) -> None:
    """minRowsPerTrigger's rule (`holds_back`): never on the first trigger, never once
    maxTriggerDelay has passed since the last batch, else while rows are too few; the
    database is asked only when it decides."""
    from plait.spark.streaming import holds_back

    asked: list[bool] = []

    def rows_enough() -> bool:
        asked.append(True)
        return enough

    waits = holds_back(now, last, delay, rows_enough)
    decides = last is not None and now - last < delay
    assert waits == (decides and not enough)
    assert asked == ([True] if decides else [])
