"""A writer's statements as plait rewrites and reads them: `{id}` becomes the stream
sequence's next value, the IDs a statement returned are checked and put in the internal
domain, and rows it returned whole are kept for the outbox."""

from __future__ import annotations

from typing import Any

from plait.errors import ConfigError
from plait.storage.stream_store import StreamStore
from plait.storage.stream_tables import StreamRow
from plait.streams.write_helpers import IdsNotReturned

# Statements given to `insert` are rewritten once and kept (applications use a handful).
SQL_CACHE_SIZE = 256


class Statements:
    """One stream's statements: rewritten once each, their results read back."""

    __slots__ = ("_sign", "_store", "_text")

    def __init__(self, store: StreamStore) -> None:
        self._store = store
        self._sign = store.spec.sign
        self._text: dict[str, str] = {}

    def with_ids(self, query: str) -> str:
        """`query` with the sequence's next value wherever it says `{id}`."""
        cached = self._text.get(query) if isinstance(query, str) else None
        if cached is not None:
            return cached
        if not isinstance(query, str) or "{id}" not in query:
            raise ConfigError(
                "the statement must say where stream IDs go: write {id} in place of each "
                "new row's ID, e.g. INSERT INTO t (stream_id, ...) VALUES ({id}, ...) "
                "RETURNING stream_id"
            )
        if len(self._text) >= SQL_CACHE_SIZE:
            self._text.clear()  # statements built on the fly: keep memory bounded
        text = self._text[query] = query.replace("{id}", self._store.next_id_sql())
        return text

    def returned_ids(self, values: list[Any] | None) -> list[int]:
        """The IDs a statement returned (its first column), internal domain, sorted."""
        if values is None:
            raise IdsNotReturned(
                "the statement returned nothing: end it with RETURNING <id column> so "
                "plait learns which stream IDs it took"
            )
        # One column has one type, so the first value tells; `type(...) is int` also
        # refuses bool, a subclass of int.
        if values and (type(values[0]) is not int or None in values):
            raise IdsNotReturned(
                "the statement must return the new stream IDs as its first column "
                "(RETURNING <id column>)"
            )
        if self._sign != 1:
            values = [-v for v in values]
        values.sort()
        return values

    def rows_of(
        self, columns: list[str] | None, records: list[Any] | None
    ) -> list[StreamRow] | None:
        """The rows a statement returned, when they are whole rows of the stream's one
        table (RETURNING *); else None."""
        if records is None or columns is None:
            return None
        build = self._store.row_builder(columns)
        return None if build is None else build(records)

    def signed(self, ids: list[int]) -> list[int]:
        """Internal IDs as the caller sees them (negative on a backwards stream), in a
        list of the caller's own: completions still hold the internal one."""
        return ids.copy() if self._sign == 1 else [-i for i in ids]

    def first_signed(self, ids: list[int]) -> int:
        return self._sign * ids[0]
