"""Paging range reads with `merge_pages` never loses or repeats a row (no database).

Each table is a sorted list of stream IDs, several rows per ID allowed. A per-table read
is simulated exactly as PostgreSQL answers `WHERE id > from AND id <= to ORDER BY id
LIMIT n`, and a page of one ID only is re-read in full, as the storage layer does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.core.pages import Page, TablePage, cut_pages, merge_pages, needs_whole_id

# A row is (stream ID, table index, row index within the table): unique and traceable.
Row = tuple[int, int, int]


@dataclass(frozen=True)
class Table:
    index: int
    ids: tuple[int, ...]  # sorted, repeats allowed

    def rows(self) -> list[Row]:
        return [(stream_id, self.index, k) for k, stream_id in enumerate(self.ids)]

    def read(self, from_exclusive: int, to_inclusive: int, limit: int) -> list[Row]:
        """`... WHERE id > from AND id <= to ORDER BY id LIMIT limit`."""
        in_range = [r for r in self.rows() if from_exclusive < r[0] <= to_inclusive]
        return in_range[:limit]

    def read_whole_id(self, stream_id: int) -> list[Row]:
        """`... WHERE id = stream_id`."""
        return [r for r in self.rows() if r[0] == stream_id]


def read_page(
    tables: list[Table], from_exclusive: int, to_inclusive: int, limit: int
) -> tuple[Page[Row], list[TablePage[Row]], frozenset[int]]:
    """One page the way the storage layer reads it (`StreamStore.read_page`)."""
    pages: list[TablePage[Row]] = []
    complete: set[int] = set()
    for table in tables:
        rows = table.read(from_exclusive, to_inclusive, limit)
        page = TablePage(ids=[r[0] for r in rows], rows=rows, limit=limit)
        whole = needs_whole_id(page)
        if whole is not None:
            assert from_exclusive < whole <= to_inclusive
            rows = table.read_whole_id(whole)
            page = TablePage(ids=[whole] * len(rows), rows=rows, limit=limit)
            complete.add(whole)
        pages.append(page)
    frozen = frozenset(complete)
    return merge_pages(pages, to_inclusive, limit, frozen), pages, frozen


def rows_between(tables: list[Table], low_exclusive: int, high_inclusive: int) -> list[Row]:
    return sorted(r for t in tables for r in t.rows() if low_exclusive < r[0] <= high_inclusive)


def page_through(
    tables: list[Table], from_exclusive: int, to_inclusive: int, limit: int
) -> list[Page[Row]]:
    """Read (from, to] page by page, checking every page on the way."""
    result: list[Page[Row]] = []
    current = from_exclusive
    total = len(rows_between(tables, from_exclusive, to_inclusive))
    while current < to_inclusive:
        # Every page makes progress, so this many pages is always enough.
        assert len(result) <= total + 1, "paging does not terminate"
        page, _, _ = read_page(tables, current, to_inclusive, limit)
        ids = [r[0] for r in page.rows]

        assert current < page.upto <= to_inclusive, (current, page)
        assert ids == sorted(ids), "rows of a page must be sorted by ID"
        # Every row in (current, upto] from every table is in the page, and nothing else.
        assert Counter(page.rows) == Counter(rows_between(tables, current, page.upto)), (
            current,
            page,
        )
        if not page.limited:
            assert page.upto == to_inclusive
        # About `limit` rows: a page is longer only by rows of its last ID.
        if len(ids) > limit:
            assert len(set(ids[limit - 1 :])) == 1, (limit, ids)
        result.append(page)
        current = page.upto
    return result


@st.composite
def paging_cases(draw: st.DrawFn) -> tuple[list[Table], int, int, int]:
    top = draw(st.integers(1, 14))
    n_tables = draw(st.integers(1, 3))
    tables = [
        Table(i, tuple(sorted(draw(st.lists(st.integers(1, top), max_size=18)))))
        for i in range(n_tables)
    ]
    from_exclusive = draw(st.integers(0, top))
    to_inclusive = draw(st.integers(from_exclusive + 1, top + 2))
    limit = draw(st.integers(1, 6))
    return tables, from_exclusive, to_inclusive, limit


@settings(max_examples=600, deadline=None)
@given(paging_cases())
def test_paging_returns_every_row_exactly_once(case: tuple[list[Table], int, int, int]) -> None:
    tables, from_exclusive, to_inclusive, limit = case
    pages = page_through(tables, from_exclusive, to_inclusive, limit)

    concatenated = [row for page in pages for row in page.rows]
    expected = rows_between(tables, from_exclusive, to_inclusive)
    assert Counter(concatenated) == Counter(expected), "a row was lost or repeated"
    assert [r[0] for r in concatenated] == [r[0] for r in expected]
    uptos = [page.upto for page in pages]
    assert uptos == sorted(set(uptos)), "upto must strictly grow"
    if pages:
        assert pages[-1].upto == to_inclusive


@settings(max_examples=300, deadline=None)
@given(paging_cases())
def test_single_page_contract(case: tuple[list[Table], int, int, int]) -> None:
    """One `merge_pages` call on its own: the `upto` it returns is safe to resume from."""
    tables, from_exclusive, to_inclusive, limit = case
    page, table_pages, _ = read_page(tables, from_exclusive, to_inclusive, limit)
    assert from_exclusive < page.upto <= to_inclusive
    assert Counter(page.rows) == Counter(rows_between(tables, from_exclusive, page.upto))
    # Nothing in the per-table pages above upto was returned.
    assert all(r[0] <= page.upto for r in page.rows)
    if not page.limited:
        assert page.upto == to_inclusive
    everything = rows_between(tables, from_exclusive, to_inclusive)
    if not any(p.full for p in table_pages) and len(everything) <= limit:
        # Nothing to cut: no table may have more, and all rows fit in one page.
        assert page.upto == to_inclusive


# -- hand-picked cases ------------------------------------------------------------------


def test_whole_id_read_in_one_table_does_not_complete_that_id_in_another() -> None:
    """Regression: a whole read of ID 5 in table A said nothing about table B's rows of 5.

    limit 2; A holds 5,5,5 and B holds 4,5,5. A's page [5,5] is re-read in full, so 5 is
    "complete"; B's page [4,5] ends in the middle of ID 5. The page must stop at 4, or the
    second row of 5 in B is never returned.
    """
    tables = [Table(0, (5, 5, 5)), Table(1, (4, 5, 5))]
    page, _, complete = read_page(tables, 0, 10, 2)
    assert complete == {5}
    assert page.upto == 4
    assert page.rows == [(4, 1, 0)]
    assert page.limited

    pages = page_through(tables, 0, 10, 2)
    assert sorted(r for p in pages for r in p.rows) == rows_between(tables, 0, 10)


def test_needs_whole_id() -> None:
    assert needs_whole_id(TablePage(ids=[3, 3], rows=["a", "b"], limit=2)) == 3
    assert needs_whole_id(TablePage(ids=[3, 3, 3], rows=["a", "b", "c"], limit=2)) == 3
    assert needs_whole_id(TablePage(ids=[3, 4], rows=["a", "b"], limit=2)) is None
    assert needs_whole_id(TablePage(ids=[3], rows=["a"], limit=2)) is None  # not full
    assert needs_whole_id(TablePage(ids=[], rows=[], limit=1)) is None
    assert needs_whole_id(TablePage(ids=[7], rows=["a"], limit=1)) == 7


def test_table_page_full() -> None:
    assert TablePage(ids=[1, 2], rows=["a", "b"], limit=2).full
    assert not TablePage(ids=[1], rows=["a"], limit=2).full
    assert not TablePage(ids=[], rows=[], limit=1).full


def test_single_id_page_without_whole_read_is_refused() -> None:
    page = TablePage(ids=[4, 4], rows=["a", "b"], limit=2)
    with pytest.raises(ValueError, match="needs a whole read"):
        merge_pages([page], 10, 2)
    # With the whole read done, everything of ID 4 comes back and the page ends at 4.
    whole = TablePage(ids=[4, 4, 4], rows=["a", "b", "c"], limit=2)
    result = merge_pages([whole], 10, 2, frozenset({4}))
    assert result == Page(rows=["a", "b", "c"], upto=4, limited=True)


def test_empty_and_short_pages_reach_to_inclusive() -> None:
    assert merge_pages([], 9, 5) == Page(rows=[], upto=9, limited=False)
    empty: TablePage[str] = TablePage(ids=[], rows=[], limit=3)
    assert merge_pages([empty, empty], 9, 3) == Page(rows=[], upto=9, limited=False)
    short = TablePage(ids=[2, 5], rows=["a", "b"], limit=3)
    assert merge_pages([short], 9, 3) == Page(rows=["a", "b"], upto=9, limited=False)


def test_merge_cuts_between_ids_across_tables() -> None:
    # Neither table is full, but together they hold more than `limit` rows.
    a = TablePage(ids=[1, 3, 5], rows=["a1", "a3", "a5"], limit=4)
    b = TablePage(ids=[2, 3, 4], rows=["b2", "b3", "b4"], limit=4)
    result = merge_pages([a, b], 10, 4)
    # The 4th row is an ID-3 row: both rows of 3 come along, and the page ends at 3.
    assert result == Page(rows=["a1", "b2", "a3", "b3"], upto=3, limited=True)


def test_full_page_is_cut_below_its_last_id() -> None:
    a = TablePage(ids=[1, 2, 2], rows=["a1", "a2", "a2'"], limit=3)
    b = TablePage(ids=[2], rows=["b2"], limit=3)
    # A may have more rows of 2, so nothing of 2 is returned yet, from either table.
    assert merge_pages([a, b], 10, 3) == Page(rows=["a1"], upto=1, limited=True)


def test_cut_pages_asks_for_a_larger_read_when_a_full_page_holds_one_id() -> None:
    one_id = TablePage([5, 5], ["a", "b"], limit=2)
    other = TablePage([3, 6], ["c", "d"], limit=2)
    assert cut_pages([one_id, other], 10, 2) is None
    wider = TablePage([5, 5, 5, 7], ["a", "b", "e", "f"], limit=4)
    assert cut_pages([wider, other], 10, 2) == merge_pages([wider, other], 10, 2)
