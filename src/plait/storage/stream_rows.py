"""Reading a stream's rows: by ID at start-up, by range for readers (`read_page`), and
whole ranges of one writer through server-side cursors for catch-up (`scan`). Values
cross in the internal domain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from psycopg import AsyncConnection, AsyncCursor, sql
from psycopg.rows import TupleRow

from plait.core.pages import Page, TablePage, merge_pages, needs_whole_id
from plait.core.spec import StreamSpec
from plait.storage.database import Database
from plait.storage.stream_tables import RowMaker, StreamRow, StreamTable, open_scan, safe_bound

logger = logging.getLogger(__name__)


class StreamRows:
    """The reads of one stream's rows, over all its tables."""

    def __init__(self, db: Database, spec: StreamSpec, tables: list[StreamTable]) -> None:
        self.db = db
        self.spec = spec
        self._tables = tables
        self._sign = spec.sign

    async def ids_above(self, floor: int, limit: int) -> tuple[list[int], int, bool]:
        """Committed IDs above `floor`, lowest first, complete up to a cutoff.

        Returns (ids, cutoff, more): every committed ID in (floor, cutoff] is in `ids`,
        and `more` says whether there may be IDs above the cutoff. One round trip for all
        tables (a pipeline). Outlasts a server restart (`Database.retry_read`).
        """

        async def read() -> tuple[list[int], int, bool]:
            async with self.db.connection() as conn:
                async with conn.pipeline():
                    pages = [
                        await conn.execute(
                            t.ids_above_query(), {"floor": t.stored(floor), "n": limit}
                        )
                        for t in self._tables
                    ]
                return await self.ids_from(pages, floor, limit)

        return await self.db.retry_read(f"the IDs of stream {self.spec.name}", read)

    async def ids_from(
        self, pages: list[AsyncCursor[TupleRow]], floor: int, limit: int
    ) -> tuple[list[int], int, bool]:
        found: list[int] = []
        cutoff: int | None = None
        for cursor in pages:
            ids = [self._sign * int(r[0]) for r in await cursor.fetchall()]
            found.extend(ids)
            if len(ids) >= limit:
                cutoff = ids[-1] if cutoff is None else min(cutoff, ids[-1])
        if cutoff is None:
            return sorted(found), max(found, default=floor), False
        return sorted(i for i in found if i <= cutoff), cutoff, True

    async def read_page(
        self, writer: str | None, from_exclusive: int, to_inclusive: int, limit: int
    ) -> Page[StreamRow]:
        """Rows with IDs in (from, to] (internal domain), of one writer or of all.
        Outlasts a server restart (`Database.retry_read`)."""
        return await self.db.retry_read(
            f"rows of stream {self.spec.name}",
            lambda: self._read_page(writer, from_exclusive, to_inclusive, limit),
        )

    async def _read_page(
        self, writer: str | None, from_exclusive: int, to_inclusive: int, limit: int
    ) -> Page[StreamRow]:
        by_writer = writer is not None
        sign = self._sign
        pages: list[TablePage[StreamRow]] = []
        complete: set[int] = set()
        async with self.db.connection() as conn:
            for table in self._tables:
                if not by_writer and not table.id_indexed:
                    self._warn_scan(table)
                params: dict[str, Any] = {
                    "writer": writer,
                    "lo": table.stored(from_exclusive),
                    "hi": table.stored(to_inclusive),
                    "n": limit,
                }
                rows = await self._fetch_rows(conn, table.range_query(by_writer), params, table)
                page = TablePage(ids=[sign * r[0] for r in rows], rows=rows, limit=limit)
                whole = needs_whole_id(page)
                if whole is not None:
                    rows = await self._fetch_rows(
                        conn,
                        table.whole_id_query(by_writer),
                        {"writer": writer, "id": table.stored(whole)},
                        table,
                    )
                    page = TablePage(ids=[whole] * len(rows), rows=rows, limit=limit)
                    complete.add(whole)
                pages.append(page)
        return merge_pages(pages, to_inclusive, limit, frozenset(complete))

    async def scan(
        self,
        writer: str,
        from_exclusive: int,
        to_inclusive: int,
        first: int,
        most: int,
        make_row: RowMaker | None = None,
    ) -> AsyncGenerator[Page[Any], None]:
        """Every row of `writer` in (from, to] (internal domain), in pages of `first` rows
        doubling up to `most`, each cut between IDs, with the page's `upto`; the last
        page ends at `to`. Rows are `StreamRow`s, or (for a stream of one table) what
        `make_row` builds from the tuples, so that a catch-up of a million rows
        allocates one object per row, not three.

        One query streamed through a server-side cursor: paging with LIMIT would plan a
        query per page, and on a freshly loaded table without statistics each of those
        sorts everything above its start. A stream of several tables gets one cursor per
        table, merged (`_merged`)."""
        if len(self._tables) != 1:
            if make_row is not None:
                raise ValueError("make_row needs a stream of one table")
            async for page in self._merged(writer, from_exclusive, to_inclusive, first, most):
                yield page
            return
        table, sign = self._tables[0], self._sign
        async with (
            self.db.connection() as conn,
            conn.transaction(),
            conn.cursor(name="plait_scan") as cur,
        ):
            columns = await open_scan(cur, table, writer, from_exclusive, to_inclusive)
            id_at = [name for name, _ in columns].index(table.spec.id_column)
            make = (make_row or self.stream_rows(table))(table.name, columns)
            held: list[tuple[Any, ...]] = []  # rows of an ID that may go on in the next batch
            size = first
            # The next batch is on its way while this one is turned into rows.
            fetching = asyncio.ensure_future(cur.fetchmany(size))
            try:
                while True:
                    records = await fetching
                    done = len(records) < size
                    size = min(2 * size, most)
                    if not done:
                        fetching = asyncio.ensure_future(cur.fetchmany(size))
                    if held:
                        records = held + records
                    if done:
                        yield Page(make(records), to_inclusive, False)
                        return
                    last = records[-1][id_at]
                    cut = len(records) - 1
                    while cut > 0 and records[cut - 1][id_at] == last:
                        cut -= 1
                    held = records[cut:]
                    if cut:
                        yield Page(make(records[:cut]), sign * records[cut - 1][id_at], True)
            finally:
                if not fetching.done():
                    fetching.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await fetching

    @staticmethod
    def stream_rows(table: StreamTable) -> RowMaker:
        """`StreamRow`s of the table's tuples (the default row maker)."""
        spec = table.spec

        def maker(
            name: str, columns: list[tuple[str, int]]
        ) -> Callable[[list[tuple[Any, ...]]], list[Any]]:
            names = [column for column, _ in columns]
            id_at, inst_at = names.index(spec.id_column), names.index(spec.instance_column)
            return lambda records: [
                StreamRow(r[id_at], r[inst_at], name, dict(zip(names, r, strict=False)))
                for r in records
            ]

        return maker

    async def _merged(
        self, writer: str, from_exclusive: int, to_inclusive: int, first: int, most: int
    ) -> AsyncGenerator[Page[StreamRow], None]:
        """`scan` for a stream of several tables: one server-side cursor per table, in
        one transaction, merged in ID order (ties in table order). A row goes out once
        every table has been read past its ID, so each page ends between IDs."""
        sign, tables = self._sign, self._tables
        async with self.db.connection() as conn, conn.transaction():
            cursors = []
            makers = []
            for n, table in enumerate(tables):
                cur = conn.cursor(name=f"plait_scan_{n}")
                columns = await open_scan(cur, table, writer, from_exclusive, to_inclusive)
                cursors.append(cur)
                makers.append(self.stream_rows(table)(table.name, columns))
            # Per table: rows fetched and not yet sent (internal ID, row), and the
            # largest ID fetched; None once the table is read to the end.
            buffers: list[list[tuple[int, StreamRow]]] = [[] for _ in tables]
            reached: list[int | None] = [from_exclusive] * len(tables)
            size = first
            try:
                while True:
                    # Read on in the tables that hold the next page back (the lowest
                    # reached); the others are ahead already.
                    lowest = min(last for last in reached if last is not None)
                    for n, cur in enumerate(cursors):
                        if reached[n] != lowest:
                            continue
                        records = await cur.fetchmany(size)
                        rows = makers[n](records)
                        buffers[n].extend((sign * row.stream_id, row) for row in rows)
                        reached[n] = None if len(records) < size else buffers[n][-1][0]
                    size = min(2 * size, most)
                    bound = safe_bound(reached)
                    done = bound is None
                    upto = to_inclusive if bound is None else bound
                    out: list[tuple[int, int, int, StreamRow]] = []
                    for n, buffer in enumerate(buffers):
                        cut = 0
                        while cut < len(buffer) and buffer[cut][0] <= upto:
                            out.append((buffer[cut][0], n, cut, buffer[cut][1]))
                            cut += 1
                        del buffer[:cut]
                    out.sort(key=lambda item: item[:3])
                    if done:
                        yield Page([item[3] for item in out], to_inclusive, False)
                        return
                    if out:
                        yield Page([item[3] for item in out], upto, True)
            finally:
                for cur in cursors:
                    await cur.close()

    def _warn_scan(self, table: StreamTable) -> None:
        """Once per table: reads across writers scan a table without an id index."""
        if table.warned_scan:
            return
        table.warned_scan = True
        logger.warning(
            "stream %s: reading all writers' rows by ID from table %s, which has no index "
            "led by %s, so every such read scans the table; create one with: "
            "CREATE INDEX CONCURRENTLY ON %s (%s)",
            self.spec.name,
            table.name,
            table.spec.id_column,
            table.name,
            table.spec.id_column,
        )

    async def _fetch_rows(
        self,
        conn: AsyncConnection[TupleRow],
        query: sql.Composed,
        params: dict[str, Any],
        table: StreamTable,
    ) -> list[StreamRow]:
        async with conn.cursor() as cur:
            await cur.execute(query, params)
            records = await cur.fetchall()
            columns = [(column.name, column.type_code) for column in cur.description or ()]
        rows: list[StreamRow] = self.stream_rows(table)(table.name, columns)(records)
        return rows
