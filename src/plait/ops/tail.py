"""`plait tail`: a stream's rows as JSON lines, each with the token that resumes after it.

Rows come from the database between two tokens (the ranges the Spark source reads, from
`stream_positions`, so never a row a writer has not persisted), in ID order across the
stream's tables, a page at a time. A row's token is the end token cut at the row's ID:
every row of the window up to it has been printed, so `--from` that token goes on with
the next row and repeats none (for a row with more rows of its ID after it, the token
stops before the ID: its rows come again rather than be skipped).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from plait.core import offsets
from plait.core.offsets import WriterRange
from plait.core.pages import TablePage, cut_pages
from plait.core.spec import StreamSpec, TableSpec
from plait.core.tokens import StreamToken
from plait.errors import ConfigError
from plait.replication.rows import jsonable
from plait.storage import catalog

PAGE = 1000
Item = tuple[int, str, dict[str, Any]]  # internal ID, table, row


@dataclass(frozen=True, slots=True)
class Line:
    """One row of a tail: the table it is in, its columns, and the token after it."""

    table: str
    id: int  # internal (always-growing) ID
    row: dict[str, Any]
    token: StreamToken

    def to_json(self, token_text: str) -> str:
        return json.dumps(
            {"token": token_text, "table": self.table, "row": self.row}, separators=(",", ":")
        )


class Tail:
    """Reads one stream on one connection (the CLI's; nothing here keeps state beyond
    the spec and the writer filter)."""

    def __init__(
        self, conn: psycopg.Connection[Any], stream: str, writer: str | None = None
    ) -> None:
        self.conn = conn
        try:
            self.spec: StreamSpec = catalog.load_spec(conn, stream)
        except ConfigError as err:
            raise ConfigError(_ours(err)) from None
        self.writer = writer
        self._ids: dict[str, int] = {}

    def token(self, value: str) -> StreamToken:
        """`value` as a token of this stream; `ValueError` saying why it is none (naming
        no option: the CLI names its flag). A token from another database is refused,
        not waited on."""
        try:
            return catalog.parse_token(self.spec, value, catalog.OnConnection(self.conn))
        except catalog.Refused as err:
            raise catalog.Refused(f"{err}; {catalog.FOREIGN_TOKEN}") from None
        except ConfigError as err:
            raise ConfigError(_ours(err)) from None

    def latest(self) -> StreamToken:
        try:
            return catalog.latest(self.conn, self.spec)
        except ConfigError as err:
            raise ConfigError(_ours(err)) from None

    def text(self, token: StreamToken) -> str:
        """The token's text form; writers get their compact id from `instance_map`,
        registered there if new (as `StreamToken.to_string` does)."""
        missing = sorted(set(token.writers) - set(self._ids))
        if missing:
            self._ids.update(catalog.instance_ids(self.conn, missing))
        return token.encode_text(self._ids)

    def between(self, start: StreamToken, end: StreamToken, page: int = PAGE) -> Iterator[Line]:
        """The rows in (start, end], in ID order, read about `page` rows at a time.

        Pages are cut between IDs (`core.pages`), so an ID with many rows is never
        split across them."""
        ranges = self._mine(offsets.ranges(start, end))
        cursor = min((r.low for r in ranges), default=0)
        while window := [replace(r, low=max(r.low, cursor)) for r in ranges if r.high > cursor]:
            high = max(r.high for r in window)
            limit = page
            while (cut := cut_pages(self._pages(window, limit), high, page)) is None:
                limit *= 2  # a full page of one ID: read more of it
            yield from _lines(start, end, cut.rows)
            cursor = cut.upto

    def last(self, count: int, end: StreamToken) -> list[Line]:
        """The last `count` rows at or below `end`, oldest first."""
        start = StreamToken(0)
        ranges = self._mine(offsets.ranges(start, end))
        if not ranges or count < 1:
            return []
        pages = [self._page(t, ranges, count, newest_first=True) for t in self.spec.tables]
        newest = heapq.nlargest(count, (item for p in pages for item in p), key=lambda x: x[0])
        return list(_lines(start, end, newest[::-1]))

    def _mine(self, ranges: list[WriterRange]) -> list[WriterRange]:
        """The ranges narrowed to `--writer`, when given."""
        if self.writer is None:
            return ranges
        out = []
        for r in ranges:
            if r.writer == self.writer:
                out.append(r)
            elif r.writer is None and self.writer not in r.others_than:
                out.append(WriterRange(self.writer, r.low, r.high))
        return out

    def _pages(self, ranges: list[WriterRange], limit: int) -> list[TablePage[Item]]:
        """A page of each table, oldest first."""
        pages = []
        for table in self.spec.tables:
            items = self._page(table, ranges, limit, newest_first=False)
            pages.append(TablePage([item[0] for item in items], items, limit))
        return pages

    def _page(
        self, table: TableSpec, ranges: list[WriterRange], limit: int, *, newest_first: bool
    ) -> list[Item]:
        names, rows = catalog.read_page(
            self.conn, table, self.spec.backwards, ranges, limit, newest_first=newest_first
        )
        return [
            (
                self.spec.sign * int(r[0]),
                table.name,
                dict(zip(names, map(jsonable, r[1:]), strict=True)),
            )
            for r in rows
        ]


def _ours(err: ConfigError) -> str:
    """The catalog's message, which it words for the Spark source, for the CLI."""
    return str(err).removeprefix("plait source: ")


def _lines(start: StreamToken, end: StreamToken, items: list[Item]) -> Iterator[Line]:
    """Rows in ID order as lines, each with the token after it; a row followed by more
    rows of its own ID gets the token before that ID, so resuming skips none of them."""
    for k, (internal, table, row) in enumerate(items):
        shared = k + 1 < len(items) and items[k + 1][0] == internal
        token = offsets.limited(start, end, internal - 1 if shared else internal)
        yield Line(table, internal, row, token)
