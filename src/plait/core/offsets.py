"""What a Spark micro-batch reads: per-writer ID ranges between two offsets. No I/O.

An offset is a stream token in its JSON form, `{"min": m, "writers": {"w1": p1, ...}}`
(internal, always-growing IDs, as everywhere inside plait): every writer is at `min`
unless listed. The offsets the source makes also name what they are offsets of:
`"stream"` and the stream's `"uid"` (made by the database when the stream was first
recorded, kept through failovers, upgrades and restores, new for a stream of the same
name in another database), so a checkpoint reused for another stream or database is
refused by name instead of read from at the wrong place.

A micro-batch from `start` to `end` reads, for each writer, the rows with its instance
name and IDs in `(start.get(w), end.get(w)]`. A writer listed in
neither offset is at `min` in both: one more range covers every such writer at once,
`(start.min, end.min]` for any instance name not listed. So a writer first seen in a
later offset is read from the previous offset's `min`, and an idle writer or one with
a transaction still open holds back nobody's rows but its own. The ranges are then cut
into slices of the ID space, one Spark task each (or, on request, into pieces of each
writer's range).

Offsets come from outside: a user's startingToken, or a checkpoint that may belong to
another database. Parsing refuses anything past BIGINT (`core.tokens`); `refusal` says
why an offset is no offset of the stream at hand (past its sequence head, or naming a
writer it does not have), for the callers to check before planning; and planning is
bounded whatever the offsets say: never more than `MAX_SLICES` slices, each wider when
the ranges are wide, so the work of planning never grows with the size of the ID range.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from plait.core import strict_json
from plait.core.tokens import MAX_TOKEN_TEXT, StreamToken
from plait.errors import TokenParseError

# Slices (Spark tasks) one batch is cut into at most; past that, slices grow wider. A
# task costs Spark more than a wider slice costs the task.
MAX_SLICES = 10_000


@dataclass(frozen=True, slots=True)
class WriterRange:
    """Rows of `writer` (or, when None, of every writer not in `others_than`) with IDs
    in (low, high] (internal domain)."""

    writer: str | None
    low: int
    high: int
    others_than: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Identity:
    """What an offset is an offset of: a stream, by name and by the uid its database
    gave it (None where the database predates uids: the name alone is then checked)."""

    stream: str
    uid: str | None

    def __str__(self) -> str:
        return f"stream {self.stream!r}" + (f" (uid {self.uid})" if self.uid else "")


_IDENTITY_KEYS = ("stream", "uid")


def to_json(token: StreamToken) -> str:
    """The canonical text of an offset: sorted keys, no spaces, one line."""
    return json.dumps(token.to_json_dict(), sort_keys=True, separators=(",", ":"))


def offset(token: StreamToken, identity: Identity) -> dict[str, object]:
    """The offset Spark keeps: the token's JSON form and what it is an offset of."""
    value: dict[str, object] = {**token.to_json_dict(), "stream": identity.stream}
    if identity.uid is not None:
        value["uid"] = identity.uid
    return value


def from_json(value: object) -> StreamToken:
    """An offset from its JSON text or the dict Spark hands back; `TokenParseError`
    (saying what is wrong) for anything else. What it names as its stream is left out
    (`parse` returns it)."""
    return parse(value)[0]


def parse(value: object) -> tuple[StreamToken, Identity | None]:
    """An offset and what it says it is an offset of (None when it says nothing: a
    token a user wrote, or an offset of a plait older than these names)."""
    if isinstance(value, str):
        if len(value) > MAX_TOKEN_TEXT:
            raise TokenParseError(
                f"offset is {len(value)} characters long; offsets are far shorter"
            )
        try:
            value = strict_json.loads(value)
        except ValueError as err:
            raise TokenParseError(f"offset is not valid JSON: {err}") from None
    if not isinstance(value, dict) or "stream" not in value:
        if isinstance(value, dict) and "uid" in value:
            raise TokenParseError('offset has a "uid" but no "stream"')
        return StreamToken.from_json_dict(value), None
    stream, uid = value.get("stream"), value.get("uid")
    if not isinstance(stream, str) or not stream or len(stream) > 200:
        raise TokenParseError('offset "stream" must be a stream\'s name')
    if uid is not None and (not isinstance(uid, str) or not uid or len(uid) > 100):
        raise TokenParseError('offset "uid" must be a stream\'s uid')
    rest = {k: v for k, v in value.items() if k not in _IDENTITY_KEYS}
    return StreamToken.from_json_dict(rest), Identity(stream, uid)


def foreign(found: Identity | None, expected: Identity) -> str | None:
    """Why an offset naming `found` is no offset of `expected` (None: it may be one).
    A uid decides when both have one; the name decides otherwise."""
    if found is None:
        return None
    if found.uid is not None and expected.uid is not None:
        same = found.uid == expected.uid
    else:
        same = found.stream == expected.stream
    if same:
        return None
    where = "" if found.stream != expected.stream else " of another database"
    return f"it is an offset of {found}{where}, not of {expected}"


def refusal(token: StreamToken, head: int, writers: Collection[str]) -> str | None:
    """Why `token` is no offset of a stream whose sequence has handed out IDs up to
    `head` and whose writers are `writers` (None: it is one)."""
    return above_head(token, head) or not_a_writer(token, writers)


def above_head(token: StreamToken, head: int) -> str | None:
    """What in `token` is past `head`, if anything: no writer of the stream can be there
    (it rules the token out wherever it came from, so it is named first)."""
    if token.min > head:
        return f"its min {token.min} is above {_HEAD} {head} ({_HEAD_MEANS})"
    for writer, position in token:
        if position > head:
            return f"it puts writer {writer!r} at {position}, above {_HEAD} {head} ({_HEAD_MEANS})"
    return None


def not_a_writer(token: StreamToken, writers: Collection[str]) -> str | None:
    """The first writer `token` names that is not among `writers`, if any."""
    for writer, _ in token:
        if writer not in writers:
            return (
                f"it names writer {writer!r}, which is not a writer of the stream "
                f"({sorted(writers)})"
            )
    return None


_HEAD = "the stream's sequence head"
_HEAD_MEANS = "the largest ID the stream has handed out"


def ranges(start: StreamToken, end: StreamToken) -> list[WriterRange]:
    """The ranges of rows in (start, end], one per writer that moved, plus one for the
    writers listed in neither offset."""
    listed = sorted(set(start.writers) | set(end.writers))
    out = [
        WriterRange(writer, start.get(writer), end.get(writer))
        for writer in listed
        if end.get(writer) > start.get(writer)
    ]
    if end.min > start.min:
        out.append(WriterRange(None, start.min, end.min, tuple(listed)))
    return out


OTHERS = "others"  # the writers an offset does not list, in `rows_behind`


def per_writer(ranges_: list[WriterRange], writers: Sequence[str]) -> list[WriterRange]:
    """The ranges of `ranges_` to count rows in, one per writer: each range of unlisted
    writers split into one per writer of `writers` it covers. What is left of such a
    range (writers outside `writers`) is kept only when it excludes no one: counting
    rows of "anyone but these" walks the whole ID range when there are none, where a
    writer's own range stops at the count's cap (its (writer, ID) index)."""
    out: list[WriterRange] = []
    for r in ranges_:
        if r.writer is not None:
            out.append(r)
            continue
        named = [w for w in writers if w not in r.others_than]
        out += [WriterRange(w, r.low, r.high) for w in named]
        if not named and not r.others_than:
            out.append(r)  # a stream any writer may write to, no writer listed yet
    return out


def rows_behind(
    writers: Sequence[str], ranges_: list[WriterRange], counts: list[int]
) -> dict[str, int]:
    """Rows each writer has past a batch's end (`counts` of `ranges_`, the ranges from
    that end to the latest offset, `per_writer`): every writer of `writers`, 0 where none
    are pending; any others together as OTHERS, where they have some."""
    behind = dict.fromkeys(writers, 0)
    for r, n in zip(ranges_, counts, strict=True):
        key = r.writer if r.writer is not None else OTHERS
        if n or key != OTHERS:
            behind[key] = behind.get(key, 0) + n
    return behind


@dataclass(frozen=True, slots=True)
class Slice:
    """One Spark task's share of a micro-batch: the IDs in (low, high] of every range
    that reaches into them (each range clipped to the slice).

    Writers take IDs from one shared sequence, so their ranges interleave: a task per
    writer range would scan the same stretch of the table once per writer. A slice
    reads each stretch once, for all of them."""

    low: int
    high: int
    ranges: tuple[WriterRange, ...]

    @property
    def everyone(self) -> bool:
        """Whether every row in (low, high] belongs to the slice: each listed writer and
        everyone else has the whole span (no per-writer condition needed)."""
        whole = [r for r in self.ranges if (r.low, r.high) == (self.low, self.high)]
        others = [r for r in whole if r.writer is None]
        named = {r.writer for r in whole if r.writer is not None}
        return any(set(r.others_than) <= named for r in others)


def slices(
    ranges_: list[WriterRange], max_ids: int, *, max_slices: int = MAX_SLICES
) -> list[Slice]:
    """The ID space the ranges cover, merged where they overlap and cut into equal
    slices of at most `max_ids` IDs (one Spark task each), or wider ones where that
    would make more than `max_slices` (or one per stretch, if there are more stretches);
    each range's IDs land in exactly one slice."""
    if max_ids < 1 or max_slices < 1:
        raise ValueError("max_ids and max_slices must be at least 1")
    spans: list[list[int]] = []  # merged (low, high] spans, in ID order
    for r in sorted(ranges_, key=lambda r: r.low):
        if r.high <= r.low:
            continue
        if spans and r.low <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], r.high)
        else:
            spans.append([r.low, r.high])
    width = _width([high - low for low, high in spans], max_ids, max_slices)
    out: list[Slice] = []
    for span_low, span_high in spans:
        for low, high in _cut(span_low, span_high, width):
            clipped = tuple(
                WriterRange(r.writer, max(r.low, low), min(r.high, high), r.others_than)
                for r in ranges_
                if r.low < high and r.high > low
            )
            out.append(Slice(low, high, clipped))
    return out


def by_writer(
    ranges_: list[WriterRange], max_ids: int, *, max_slices: int = MAX_SLICES
) -> list[Slice]:
    """One task per writer range, cut into equal pieces of at most `max_ids` IDs when
    larger, or wider ones where that would make more than `max_slices` pieces (SPEC
    R-SP-1's layout; `slices` reads interleaved writers with fewer scans)."""
    if max_ids < 1 or max_slices < 1:
        raise ValueError("max_ids and max_slices must be at least 1")
    moved = [r for r in ranges_ if r.high > r.low]
    width = _width([r.high - r.low for r in moved], max_ids, max_slices)
    return [
        Slice(low, high, (WriterRange(r.writer, low, high, r.others_than),))
        for r in moved
        for low, high in _cut(r.low, r.high, width)
    ]


def _width(lengths: list[int], max_ids: int, max_slices: int) -> int:
    """The widest piece: `max_ids`, unless stretches of these `lengths` would then make
    more than `max_slices` pieces; then wide enough for `max_slices` in all, or one per
    stretch when there are more stretches than that."""

    def pieces(width: int) -> int:
        return sum(-(-n // width) for n in lengths)

    if pieces(max_ids) <= max_slices:
        return max_ids
    even = max(max_ids, -(-sum(lengths) // max_slices))
    if pieces(even) <= max_slices:
        return even
    # Rounding up per stretch made too many: each stretch makes at most
    # length/width + 1 pieces, so leave one spare piece per stretch.
    return max(max_ids, -(-sum(lengths) // max(max_slices - len(lengths), 1)))


def _cut(low: int, high: int, max_ids: int) -> list[tuple[int, int]]:
    """(low, high] as few pieces of at most `max_ids` IDs as possible, of equal size."""
    count = -(-(high - low) // max_ids)
    cuts = [low + (high - low) * i // count for i in range(count + 1)]
    return list(itertools.pairwise(cuts))


def limited(start: StreamToken, latest: StreamToken, cutoff: int) -> StreamToken:
    """`latest` cut at ID `cutoff`: every writer's position at most `cutoff` but never
    behind `start` (a read limit: the rows up to the cutoff are the ones allowed)."""
    writers = set(start.writers) | set(latest.writers)
    low = max(start.min, min(latest.min, cutoff))
    positions = {w: max(start.get(w), min(latest.get(w), cutoff)) for w in writers}
    return StreamToken.normalised(low, positions)
