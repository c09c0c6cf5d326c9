"""Invalidation rows: what travels on the `caches` stream, and the rules for cache keys.
No I/O.

A row names a cache and one key tuple, or no key ("everything in that cache"). A row
under a *pseudo-cache* name carries `(*shared, items)`: the receiver's expander turns it
into invalidations of real caches (one room-state change: the member list plus an entry
per member), so one change sends a few rows, not hundreds. `split_items` keeps each of
those rows under `MAX_ROW_BYTES`.

Keys cross processes as JSON, so a cache key must read back equal to itself: str, int,
float, bool, None, and tuples of those. A UUID or datetime key would come back as a
string and never match, leaving the entry stale; such keys are refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from plait.core.commands import MAX_LINE_BYTES
from plait.core.spec import StreamSpec, TableSpec
from plait.errors import CacheKeyError
from plait.storage.cache_rows import CACHES_SEQUENCE, CACHES_TABLE
from plait.storage.stream_tables import StreamRow

Key = tuple[Any, ...]
# The JSON text of one row's keys is kept under this, far below the wire line limit,
# so an invalidation always travels live and a Redis message stays small.
MAX_ROW_BYTES = min(64 * 1024, MAX_LINE_BYTES // 8)
CACHES_STREAM = "caches"


def caches_stream_spec() -> StreamSpec:
    """The `caches` stream: plait's own table and sequence (created by migration 2),
    any writer. Its positions are not stored: caches start empty after a restart, so
    nobody needs to resume it (R-ID-12)."""
    return StreamSpec(
        name=CACHES_STREAM, tables=(TableSpec(CACHES_TABLE),), sequence=CACHES_SEQUENCE
    )


_SCALARS = (str, int, float, bool, type(None))


class Invalidation(NamedTuple):
    """Drop `keys` from cache `cache_name` (every entry when `keys` is None)."""

    cache_name: str
    keys: Key | None


def check_key(key: Key, cache_name: str) -> Key:
    """`key` if every part survives a trip through JSON unchanged; else a clear error."""
    for part in key:
        if not _json_safe(part):
            raise CacheKeyError(
                f"cache {cache_name!r}: key part {part!r} ({type(part).__name__}) cannot be "
                "invalidated across instances: keys travel as JSON, so use str, int, float, "
                "bool, None or tuples of them (for example str(uuid) instead of a UUID)"
            )
    return key


def _json_safe(value: Any) -> bool:
    if isinstance(value, _SCALARS):
        return not (isinstance(value, float) and (value != value or value in _INFINITIES))
    if isinstance(value, tuple):
        return all(_json_safe(v) for v in value)
    return False


_INFINITIES = (float("inf"), float("-inf"))


def freeze(value: Any) -> Any:
    """A JSON value as a hashable one: arrays become tuples (as they were sent)."""
    if isinstance(value, list):
        return tuple(freeze(v) for v in value)
    return value


def keys_json(keys: Key | None) -> str:
    """A key tuple as the JSON text stored and sent."""
    return json.dumps(None if keys is None else list(keys), separators=(",", ":"))


def row_size(cache_name: str, keys: Key | None) -> int:
    return len(cache_name.encode()) + len(keys_json(keys).encode())


def split_items(
    cache_name: str, shared: Key, items: Sequence[Any], limit: int = MAX_ROW_BYTES
) -> list[Key]:
    """The rows `(*shared, chunk)` of a pseudo-cache invalidation, each under `limit`
    bytes of JSON, together holding every item once, in order. An empty `items` still
    gives one row (the change itself may mean something to the expander)."""
    head = row_size(cache_name, (*shared, ()))
    if head > limit:
        raise ValueError(
            f"pseudo-cache {cache_name!r}: the shared keys alone take {head} bytes, over "
            f"the {limit}-byte row limit"
        )
    rows: list[Key] = []
    chunk: list[Any] = []
    size = head
    for item in items:
        # An item adds its JSON and a comma; `keys_json` writes no spaces.
        cost = len(json.dumps(item, separators=(",", ":")).encode()) + 1
        if head + cost > limit:
            raise ValueError(
                f"pseudo-cache {cache_name!r}: the item {_shorten(item)} alone makes a row "
                f"over the {limit}-byte limit"
            )
        if chunk and size + cost > limit:
            rows.append((*shared, tuple(chunk)))
            chunk, size = [], head
        chunk.append(item)
        size += cost
    rows.append((*shared, tuple(chunk)))
    return rows


def _shorten(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class InvalidationRows:
    """The row type of the `caches` stream: `Invalidation`s, sent as `[name, keys]`."""

    def from_db(self, row: StreamRow) -> Invalidation:
        data = row.data
        return Invalidation(data["cache_name"], _received_keys(data["keys"]))

    def to_json(self, row: Invalidation) -> Any:
        return [row.cache_name, None if row.keys is None else list(row.keys)]

    def from_json(self, value: Any) -> Invalidation:
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not isinstance(value[0], str)
            or not (value[1] is None or isinstance(value[1], list))
        ):
            raise ValueError(f"expected [cache name, keys or null], not {_shorten(value)}")
        return Invalidation(value[0], _received_keys(value[1]))


def _received_keys(value: Any) -> Key | None:
    """Keys from a peer or a stored row as a tuple; None ("every entry of that cache")
    for keys no cache could hold, such as an object: a key that cannot be looked up
    would fail the whole batch of invalidations, and dropping every entry never leaves
    one stale."""
    frozen = freeze(value)
    return frozen if isinstance(frozen, tuple) and _json_safe(frozen) else None


def as_rows(invalidations: Iterable[Invalidation]) -> str:
    """Rows for the insert statement: a JSON array of `[name, keys]`."""
    codec = InvalidationRows()
    return json.dumps([codec.to_json(i) for i in invalidations], separators=(",", ":"))
