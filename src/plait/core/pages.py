"""Cutting range reads into pages without losing or repeating a row. Pure: no I/O.

A fact may have several rows with the same stream ID, in one table or in several. A
per-table read with `LIMIT n` may therefore stop in the middle of an ID. This module
decides, from the pages each table returned, the `upto` below which everything was read,
so the caller returns every row with ID <= upto and resumes strictly above it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

Row = TypeVar("Row")


@dataclass(frozen=True, slots=True)
class TablePage(Generic[Row]):
    """Rows one table returned for (from, to], sorted by `ids` (internal domain)."""

    ids: Sequence[int]
    rows: Sequence[Row]
    limit: int

    @property
    def full(self) -> bool:
        """The table may have more rows in range than it returned."""
        return len(self.ids) >= self.limit


@dataclass(frozen=True, slots=True)
class Page(Generic[Row]):
    rows: list[Row]
    upto: int
    limited: bool


def needs_whole_id(page: TablePage[Row]) -> int | None:
    """The ID to re-read in full when a full page holds one ID only, else None.

    Such a page cannot be cut below its only ID without returning nothing, so the
    caller fetches every row of that ID and passes the complete page to `merge_pages`.
    """
    if page.full and page.ids and page.ids[0] == page.ids[-1]:
        return page.ids[0]
    return None


def merge_pages(
    pages: Sequence[TablePage[Row]],
    to_inclusive: int,
    limit: int,
    complete_ids: frozenset[int] = frozenset(),
) -> Page[Row]:
    """Merge per-table pages under one shared `upto`.

    `complete_ids` are IDs whose rows were read in full (see `needs_whole_id`). The
    result has every row with ID <= upto from every table, and about `limit` rows: it
    is cut only between IDs, so an ID with many rows may make it a little longer.
    """
    upto = to_inclusive
    limited = False
    for page in pages:
        if not page.full or not page.ids:
            continue
        last = page.ids[-1]
        # The last ID of a full page may be cut short, unless this page is the whole read
        # of that ID. `complete_ids` is shared by all tables: another table's whole read
        # of `last` says nothing about this table's rows of `last`.
        whole = page.ids[0] == last
        if whole and last not in complete_ids:
            raise ValueError(f"page of one ID {last} needs a whole read first")
        safe = last if whole else last - 1
        if safe < upto:
            upto = safe
            limited = True

    if len(pages) == 1:
        return _one_table(pages[0], upto, limited, limit)
    merged: list[tuple[int, int, int, Row]] = []
    for table_index, page in enumerate(pages):
        for position, (stream_id, row) in enumerate(zip(page.ids, page.rows, strict=True)):
            if stream_id <= upto:
                merged.append((stream_id, table_index, position, row))
    merged.sort(key=lambda item: item[:3])

    if len(merged) > limit:
        cut = merged[limit - 1][0]
        if cut < upto:
            upto = cut
            limited = True
            merged = [item for item in merged if item[0] <= cut]
    return Page(rows=[item[3] for item in merged], upto=upto, limited=limited)


def cut_pages(pages: Sequence[TablePage[Row]], to_inclusive: int, limit: int) -> Page[Row] | None:
    """`merge_pages` for readers that read again with a larger limit rather than
    fetching one ID whole: None when a full page holds one ID only."""
    if any(needs_whole_id(page) is not None for page in pages):
        return None
    return merge_pages(pages, to_inclusive, limit)


def _one_table(page: TablePage[Row], upto: int, limited: bool, limit: int) -> Page[Row]:
    """`merge_pages` for a single table, whose rows are sorted already: the same cuts,
    without building and sorting a merged list (catch-up reads millions of rows)."""
    ids = page.ids
    count = bisect_right(ids, upto)
    if count > limit:
        cut = ids[limit - 1]
        if cut < upto:
            upto = cut
            limited = True
            count = bisect_right(ids, cut)
    rows = page.rows
    return Page(
        rows=list(rows) if count == len(rows) else list(rows[:count]), upto=upto, limited=limited
    )
