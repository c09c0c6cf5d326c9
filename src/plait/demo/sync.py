"""What `GET /sync` returns: a user's new rows of a stream between two vector tokens
(events of the user's rooms, the user's account data), read from the database in ID
order across the stream's tables, about `limit` rows (cut only between IDs); when cut
short, the token moves only as far as the rows returned, so the next sync repeats and
skips nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from plait.core import offsets
from plait.core.pages import TablePage, cut_pages
from plait.core.spec import StreamSpec
from plait.core.tokens import StreamToken
from plait.storage.database import Database
from plait.storage.range_sql import page_query

LIMIT = 100

# What each table of the two streams returns, and the column a sync filters it by.
COLUMNS = {
    "events": ("room_id", "sender", "body"),
    "room_state": ("room_id", "user_id", "membership"),
    "backfill_events": ("room_id", "sender", "body"),
    "global_account_data": ("kind", "content"),
    "room_account_data": ("room_id", "kind", "content"),
    "room_tags": ("room_id", "tag", "content"),
}


@dataclass(frozen=True, slots=True)
class Page:
    rows: list[dict[str, Any]]
    token: StreamToken  # where the next sync starts


async def rows_between(
    db: Database,
    spec: StreamSpec,
    by: str,
    values: Sequence[str],
    start: StreamToken,
    end: StreamToken,
    limit: int = LIMIT,
) -> Page:
    """Rows of the stream's tables in (start, end] whose column `by` is one of
    `values`, in ID order, at most `limit`."""
    ranges = offsets.ranges(start, end)
    if not ranges or not values:
        return Page([], end)
    where = sql.SQL("{} = ANY({})").format(sql.Identifier(by), sql.Literal(list(values)))
    read = limit
    while True:  # pages are cut between IDs (`core.pages`); one ID filling a page: read more
        pages = []
        async with db.connection() as conn:
            for table in spec.tables:
                columns = (table.instance_column, *COLUMNS[table.name])
                query = page_query(
                    table, spec.backwards, ranges, read, columns=columns, where=where
                )
                cursor = await conn.execute(query)
                ids, items = [], []
                for stream_id, writer, *row in await cursor.fetchall():
                    item = {"stream_id": stream_id, "writer": writer, "table": table.name}
                    item.update(zip(COLUMNS[table.name], row, strict=True))
                    ids.append(spec.sign * int(stream_id))  # internal ID
                    items.append(item)
                pages.append(TablePage(ids, items, read))
        cut = cut_pages(pages, max(r.high for r in ranges), limit)
        if cut is not None:
            break
        read *= 2
    token = offsets.limited(start, end, cut.upto) if cut.limited else end
    return Page(cut.rows, token)


class Notifier:
    """Wakes long-polls when rows arrive: a counter that only grows, and one
    condition to wait on (a wake-up between reading and waiting is never lost)."""

    def __init__(self) -> None:
        self.generation = 0
        self._changed = asyncio.Condition()

    async def notify(self) -> None:
        async with self._changed:
            self.generation += 1
            self._changed.notify_all()

    async def wait_past(self, generation: int, within: float) -> bool:
        """True once the counter moved past `generation`; False on timeout."""
        try:
            async with asyncio.timeout(within), self._changed:
                await self._changed.wait_for(lambda: self.generation > generation)
        except TimeoutError:
            return False
        return True
