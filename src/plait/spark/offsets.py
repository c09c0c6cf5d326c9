"""What a Spark micro-batch reads: per-writer ID ranges between two offsets. No I/O.

An offset is a stream token in its JSON form, `{"min": m, "writers": {"w1": p1, ...}}`
(internal, always-growing IDs, as everywhere inside plait): every writer is at `min`
unless listed. A micro-batch from `start` to `end` reads, for each writer, the rows
with its instance name and IDs in `(start.get(w), end.get(w)]`. A writer listed in
neither offset is at `min` in both: one more range covers every such writer at once,
`(start.min, end.min]` for any instance name not listed. So a writer first seen in a
later offset is read from the previous offset's `min`, and an idle writer or one with
a transaction still open holds back nobody's rows but its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from plait.core.tokens import StreamToken
from plait.errors import TokenParseError


@dataclass(frozen=True, slots=True)
class WriterRange:
    """Rows of `writer` (or, when None, of every writer not in `others_than`) with IDs
    in (low, high] (internal domain)."""

    writer: str | None
    low: int
    high: int
    others_than: tuple[str, ...] = ()

    @property
    def ids(self) -> int:
        return self.high - self.low


def to_json(token: StreamToken) -> str:
    """The canonical text of an offset: sorted keys, no spaces, one line."""
    return json.dumps(token.to_json_dict(), sort_keys=True, separators=(",", ":"))


def from_json(value: object) -> StreamToken:
    """An offset from its JSON text or the dict Spark hands back; `TokenParseError`
    (saying what is wrong) for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise TokenParseError(f"offset is not valid JSON: {err}") from None
    return StreamToken.from_json_dict(value)


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


def split(ranges_: list[WriterRange], max_ids: int) -> list[WriterRange]:
    """Each range cut into pieces of at most `max_ids` IDs (one Spark task each)."""
    if max_ids < 1:
        raise ValueError("max_ids must be at least 1")
    out: list[WriterRange] = []
    for r in ranges_:
        low = r.low
        while low < r.high:
            high = min(r.high, low + max_ids)
            out.append(WriterRange(r.writer, low, high, r.others_than))
            low = high
    return out


def limited(start: StreamToken, latest: StreamToken, cutoff: int) -> StreamToken:
    """`latest` cut at ID `cutoff`: every writer's position at most `cutoff` but never
    behind `start` (a read limit: the rows up to the cutoff are the ones allowed)."""
    writers = set(start.writers) | set(latest.writers)
    low = max(start.min, min(latest.min, cutoff))
    positions = {w: max(start.get(w), min(latest.get(w), cutoff)) for w in writers}
    return StreamToken.normalised(low, positions)
