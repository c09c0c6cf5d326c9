"""What `GET /sync` returns: a user's new events between two vector tokens, read from
the database in ID order across the `events` stream's two tables, at most `limit` rows;
when cut short, the token moves only as far as the rows returned, so the next sync
repeats and skips nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from plait.core.tokens import StreamToken
from plait.spark import catalog, offsets
from plait.storage.database import Database
from plait.streams.spec import StreamSpec

LIMIT = 100

_COLUMNS = {
    "events": ("room_id", "sender", "body"),
    "room_state": ("room_id", "user_id", "membership"),
}


@dataclass(frozen=True, slots=True)
class Page:
    events: list[dict[str, Any]]
    token: StreamToken  # where the next sync starts


async def events_between(
    db: Database,
    spec: StreamSpec,
    rooms: Sequence[str],
    start: StreamToken,
    end: StreamToken,
    limit: int = LIMIT,
) -> Page:
    ranges = offsets.ranges(start, end)
    if not ranges or not rooms:
        return Page([], end)
    found: list[tuple[int, dict[str, Any]]] = []
    for table in spec.tables:
        columns = _COLUMNS[table.name]
        condition = sql.SQL(" OR ").join(
            sql.SQL("({})").format(catalog.range_condition(table, spec.backwards, r))
            for r in ranges
        )
        query = sql.SQL(
            "SELECT {id}, {writer}, {cols} FROM {t} WHERE {room} = ANY(%s) AND ({cond})"
            " ORDER BY {id} LIMIT {limit}"
        ).format(
            id=sql.Identifier(table.id_column),
            writer=sql.Identifier(table.instance_column),
            cols=sql.SQL(", ").join(map(sql.Identifier, columns)),
            t=sql.Identifier(table.name),
            room=sql.Identifier("room_id"),
            cond=condition,
            limit=limit + 1,
        )
        async with db.connection() as conn:
            cursor = await conn.execute(query, (list(rooms),))
            for stream_id, writer, *values in await cursor.fetchall():
                event = {"stream_id": stream_id, "writer": writer, "kind": table.name}
                event.update(zip(columns, values, strict=True))
                found.append((int(stream_id), event))
    found.sort(key=lambda item: item[0])
    if len(found) <= limit:
        return Page([event for _, event in found], end)
    kept = found[:limit]
    return Page([event for _, event in kept], offsets.limited(start, end, kept[-1][0]))


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
