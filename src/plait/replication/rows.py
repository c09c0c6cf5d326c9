"""Row types: how a stream's rows travel in RDATA and reach the application.

A receiver gets rows two ways: live, as JSON inside RDATA, and while catching up, read
from the database (or, for in-memory streams, as JSON over HTTP). A `RowCodec` makes
both arrive as the same Python value, so `on_rows` never has to care which way a row
came.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import uuid
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from plait.storage.stream_tables import StreamRow

R = TypeVar("R")
_JSON_SCALARS = frozenset({str, int, bool})
# PostgreSQL types whose values psycopg returns as JSON values (bool, int2/4/8, oid,
# text, varchar, bpchar, name, json, jsonb): no conversion needed.
JSON_SAFE_TYPES = frozenset({16, 21, 23, 20, 26, 25, 1043, 1042, 19, 114, 3802})


class RowCodec(Protocol[R]):
    """Turns a stream's rows into the application's row type and back to JSON."""

    def from_db(self, row: StreamRow) -> R:
        """A row read from a stream table."""
        ...

    def to_json(self, row: R) -> Any:
        """The row as a JSON value (for RDATA and the HTTP catch-up)."""
        ...

    def from_json(self, value: Any) -> R:
        """A row that arrived as JSON."""
        ...


@runtime_checkable
class BatchRowCodec(RowCodec[R], Protocol[R]):
    """A `RowCodec` that also builds rows straight from the database's tuples, a page at
    a time (catch-up reads millions). What `row_maker`'s function returns for a page
    must equal `from_db` of each of its rows."""

    def row_maker(
        self, table: str, columns: list[tuple[str, int]]
    ) -> Callable[[list[tuple[Any, ...]]], list[R]]:
        """A function from one page's tuples of `table` (columns: name and type OID)
        to its rows."""
        ...


class DictRows:
    """The default row type: a dict of the row's columns with JSON-safe values
    (timestamps and dates as ISO 8601 text, decimals and UUIDs as text, bytes as
    base64), so a row looks the same whether it came live or from the database."""

    def from_db(self, row: StreamRow) -> dict[str, Any]:
        data = row.data
        for value in data.values():
            if value is not None and type(value) not in _JSON_SCALARS:
                return {name: jsonable(v) for name, v in data.items()}
        return data  # JSON-safe already (each read builds fresh dicts: no copy needed)

    def to_json(self, row: dict[str, Any]) -> Any:
        return row

    def row_maker(
        self, table: str, columns: list[tuple[str, int]]
    ) -> Callable[[list[tuple[Any, ...]]], list[Any]]:
        """Rows straight from the database's tuples, a batch at a time (catch-up reads
        millions): `from_db` without the `StreamRow` in between, converting only the
        columns whose type can hold values that are not JSON."""
        return _dict_rows([(name, oid not in JSON_SAFE_TYPES) for name, oid in columns])

    def from_json(self, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object for a row, not {type(value).__name__}")
        return value


class JsonRows:
    """Rows that are JSON values already (in-memory streams): passed through."""

    def from_db(self, row: StreamRow) -> Any:
        return DictRows().from_db(row)

    def to_json(self, row: Any) -> Any:
        return row

    def from_json(self, value: Any) -> Any:
        return value


def _dict_rows(
    columns: list[tuple[str, bool]],
) -> Callable[[list[tuple[Any, ...]]], list[dict[str, Any]]]:
    """A function turning tuples into dicts with these keys, `jsonable` applied where
    flagged. Generated code, as `collections.namedtuple` and `dataclasses` do: a dict
    display runs about 7 times faster than `dict(zip(names, row))`, and catch-up builds
    one dict per row. The names enter the code only as `repr()` string literals."""
    items = ", ".join(
        f"{name!r}: {'jsonable(' if convert else ''}r[{i}]{')' if convert else ''}"
        for i, (name, convert) in enumerate(columns)
    )
    build: Callable[[list[tuple[Any, ...]]], list[dict[str, Any]]] = eval(
        f"lambda records: [{{{items}}} for r in records]", {"jsonable": jsonable}
    )
    return build


def jsonable(value: Any) -> Any:
    """A database value as a JSON value."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | uuid.UUID | datetime.timedelta):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value)
