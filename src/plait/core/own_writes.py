"""A writer's completed writes that were not sent yet, with their rows when known.
No I/O.

The replication sender asks for this writer's rows in (sent, position]. Every own ID
that completed since tracking began is recorded here, with its rows when the write
handed them over (an insert that returned whole rows) or as unknown. When every ID of
the range is known the rows are sent from here; otherwise the range is read back from
the database. Since tracking begins before the first write, an ID missing from here is
an ID this writer never wrote, unless it lies in a range marked unknown: a statement
that took its IDs at COMMIT and lost its connection there may have committed IDs that
nobody can name, and a range holding them is always read back.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from typing import Generic, TypeVar

Row = TypeVar("Row")


class OwnWrites(Generic[Row]):
    """Completed own IDs in order, each with its rows or None (not known)."""

    __slots__ = ("_ids", "_rows", "_unknown")

    def __init__(self) -> None:
        self._ids: list[int] = []  # sorted; IDs complete almost in order, so appends
        self._rows: dict[int, list[Row] | None] = {}
        self._unknown: list[tuple[int, int]] = []  # (low, high]: IDs nobody can name

    def __len__(self) -> int:
        return len(self._ids)

    def record(self, ids: list[int], rows: dict[int, list[Row]] | None) -> None:
        """IDs completed; `rows` maps each to its rows (an ID absent from it has none),
        or is None when the rows are not known."""
        for stream_id in ids:
            if stream_id in self._rows:
                raise ValueError(f"ID {stream_id} recorded twice")
            self._rows[stream_id] = None if rows is None else rows.get(stream_id, [])
            if not self._ids or stream_id > self._ids[-1]:
                self._ids.append(stream_id)
            else:
                insort(self._ids, stream_id)

    def unknown(self, low: int, high: int) -> None:
        """This writer may have written IDs in (low, high] that it cannot name."""
        if high > low:
            self._unknown.append((low, high))

    def known(self, from_exclusive: int, to_inclusive: int) -> list[tuple[int, list[Row]]] | None:
        """(ID, rows) of every recorded ID in (from, to], in order; None when the rows
        of any of them are not known, or the range meets one marked unknown."""
        for low, high in self._unknown:
            if max(low, from_exclusive) < min(high, to_inclusive):
                return None
        ids = self._ids
        window = ids[bisect_right(ids, from_exclusive) : bisect_right(ids, to_inclusive)]
        found: list[tuple[int, list[Row]]] = []
        for stream_id in window:
            rows = self._rows[stream_id]
            if rows is None:
                return None
            found.append((stream_id, rows))
        return found

    def drop_upto(self, upto: int) -> None:
        """Everything at or below `upto` was sent."""
        if self._unknown:
            self._unknown = [(max(low, upto), high) for low, high in self._unknown if high > upto]
        cut = bisect_right(self._ids, upto)
        for stream_id in self._ids[:cut]:
            del self._rows[stream_id]
        del self._ids[:cut]
