"""A writer's completed writes that were not sent yet, with their rows when known.
No I/O.

The replication sender asks for this writer's rows in (sent, position]. Every own ID
that completed since tracking began is recorded here, with its rows when the write
handed them over (an insert that returned whole rows) or as unknown. When every ID of
the range is known the rows are sent from here; otherwise the range is read back from
the database. Since tracking begins before the first write, an ID missing from here is
an ID this writer never wrote.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from typing import Generic, TypeVar

Row = TypeVar("Row")


class OwnWrites(Generic[Row]):
    """Completed own IDs in order, each with its rows or None (not known)."""

    __slots__ = ("_ids", "_rows")

    def __init__(self) -> None:
        self._ids: list[int] = []  # sorted; IDs complete almost in order, so appends
        self._rows: dict[int, list[Row] | None] = {}

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

    def known(self, from_exclusive: int, to_inclusive: int) -> list[tuple[int, list[Row]]] | None:
        """(ID, rows) of every recorded ID in (from, to], in order; None when the rows
        of any of them are not known."""
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
        cut = bisect_right(self._ids, upto)
        for stream_id in self._ids[:cut]:
            del self._rows[stream_id]
        del self._ids[:cut]
