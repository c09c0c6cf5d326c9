"""`CacheRegistry`: the caches of one instance, and their invalidation everywhere.

Writing (R-CA-1): `invalidate`, `invalidate_bulk`, `invalidate_all` and
`invalidate_batch` add rows to the `caches` stream inside the caller's transaction.
They are gathered and written by one statement that travels with COMMIT (no round trip
of its own, however many there are); the IDs of all of them come from that one
statement. Once COMMIT succeeded, this instance's own caches are invalidated first,
before any stream ID of the transaction completes; other instances apply the rows as
they arrive over replication, or read them back when they catch up.

Receiving (R-CA-2, R-CA-3): rows naming a cache here invalidate it; a pseudo-cache's
rows go through its expander; other names are ignored. The replication handler calls
`apply` before the stream's position moves, so nothing observes the position before the
invalidations took effect.
"""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, ParamSpec, TypeVar

from plait.caches.cache import DEFAULT_MAX_ENTRIES, Cache
from plait.caches.cached import CachedFunction
from plait.caches.invalidations import (
    MAX_ROW_BYTES,
    Invalidation,
    Key,
    as_rows,
    check_key,
    row_size,
    split_items,
)
from plait.errors import CacheKeyError, ConfigError
from plait.replication.metrics import CacheSnapshot, ReplicationMetrics
from plait.storage.cache_rows import INSERT_ROWS
from plait.storage.database import Database
from plait.storage.transaction import Params, Transaction
from plait.streams.generator import MultiWriterIdGenerator

logger = logging.getLogger(__name__)
P = ParamSpec("P")
V = TypeVar("V")
# expander(*shared, items) -> the real invalidations: (cache name, key or None) pairs.
Expander = Callable[..., Iterable[tuple[str, Key | None]]]


class CacheRegistry:
    """Caches by name, pseudo-cache expanders, and the invalidation API."""

    def __init__(self, instance_name: str, metrics: ReplicationMetrics) -> None:
        self.instance_name = instance_name
        self.metrics = metrics
        self._caches: dict[str, Cache[Any]] = {}
        self._arity: dict[str, int] = {}
        self._expanders: dict[str, Expander] = {}
        self._pending: weakref.WeakKeyDictionary[Transaction, _Pending] = (
            weakref.WeakKeyDictionary()
        )
        self._gen: MultiWriterIdGenerator | None = None
        self._db: Database | None = None
        metrics.watch_caches(self._snapshots)

    # -- declaring ----------------------------------------------------------------------

    def cached(
        self, *, name: str | None = None, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> Callable[[Callable[P, Awaitable[V]]], CachedFunction[P, V]]:
        """Decorator: cache an async function's results by its arguments, in an LRU of
        `max_entries`, under `name` (default: the function's qualified name, which must
        be the same on every instance that invalidates it)."""

        def decorate(function: Callable[P, Awaitable[V]]) -> CachedFunction[P, V]:
            cache_name = name or getattr(function, "__qualname__", None) or repr(function)
            cached = CachedFunction(function, Cache[V](cache_name, max_entries))
            self._add(cached.cache, cached.arity)
            return cached

        return decorate

    def cache(self, name: str, max_entries: int = DEFAULT_MAX_ENTRIES) -> Cache[Any]:
        """A plain named cache (`get`/`get_or_load`/`set`), invalidated like the others."""
        cache: Cache[Any] = Cache(name, max_entries)
        self._add(cache, None)
        return cache

    def pseudo_cache(self, name: str) -> Callable[[Expander], Expander]:
        """Decorator: `name` is a pseudo-cache; a row `invalidate_batch(txn, name,
        shared, items)` becomes the invalidations `expander(*shared, items)` yields, on
        every instance (items arrive as a tuple, possibly in several parts)."""

        def decorate(expander: Expander) -> Expander:
            self._check_new(name)
            self._expanders[name] = expander
            return expander

        return decorate

    def _add(self, cache: Cache[Any], arity: int | None) -> None:
        self._check_new(cache.name)
        self._caches[cache.name] = cache
        if arity is not None:
            self._arity[cache.name] = arity

    def _check_new(self, name: str) -> None:
        _check_string(name)
        if name in self._caches or name in self._expanders:
            raise ConfigError(
                f"a cache named {name!r} exists already; give one of them another name "
                "(cached(name=...))"
            )

    def __getitem__(self, name: str) -> Cache[Any]:
        try:
            return self._caches[name]
        except KeyError:
            known = sorted(self._caches)
            raise KeyError(f"no cache named {name!r}; caches here: {known}") from None

    # -- writing ------------------------------------------------------------------------

    def bind(self, generator: MultiWriterIdGenerator, db: Database) -> None:
        """Write invalidation rows with this generator of the `caches` stream."""
        self._gen = generator
        self._db = db

    async def invalidate(self, txn: Transaction | None, cache_name: str, keys: Key) -> None:
        """Invalidate one key of `cache_name` here and on every instance, once `txn`
        commits (None: at once, in a transaction of its own)."""
        await self._write(txn, [Invalidation(cache_name, self._key(cache_name, keys))])

    async def invalidate_bulk(
        self, txn: Transaction | None, cache_name: str, keys: Iterable[Key]
    ) -> None:
        """Invalidate many keys of one cache: one row per key tuple, all of them (with
        every other invalidation of the transaction) written and numbered by a single
        statement."""
        await self._write(txn, [Invalidation(cache_name, self._key(cache_name, k)) for k in keys])

    async def invalidate_all(self, txn: Transaction | None, cache_name: str) -> None:
        """Drop every entry of `cache_name`, here and on every instance."""
        self._check_name(cache_name)
        await self._write(txn, [Invalidation(cache_name, None)])

    async def invalidate_batch(
        self,
        txn: Transaction | None,
        pseudo_cache: str,
        shared: Key,
        items: Sequence[Any] = (),
    ) -> None:
        """One change that invalidates many entries: rows `(*shared, items)` under a
        pseudo-cache name, which every instance expands with its expander. Items are
        split over several rows when one would be too long."""
        self._check_name(pseudo_cache, pseudo=True)
        if pseudo_cache in self._caches:
            raise ConfigError(
                f"{pseudo_cache!r} is a cache, not a pseudo-cache: use invalidate or "
                "invalidate_bulk"
            )
        shared = self._tuple(pseudo_cache, shared, "shared keys")
        items = list(items)
        check_key((*shared, tuple(items)), pseudo_cache)
        rows = split_items(pseudo_cache, shared, items)
        await self._write(txn, [Invalidation(pseudo_cache, row) for row in rows])

    def _key(self, cache_name: str, keys: Key) -> Key:
        self._check_name(cache_name)
        key = self._tuple(cache_name, keys, "key")
        arity = self._arity.get(cache_name)
        if arity is not None and len(key) != arity:
            raise CacheKeyError(
                f"cache {cache_name!r} is keyed by {arity} argument(s), but the key {key!r} "
                f"has {len(key)}: it would never match an entry"
            )
        check_key(key, cache_name)
        if _may_be_long(key) and row_size(cache_name, key) > MAX_ROW_BYTES:
            raise CacheKeyError(
                f"cache {cache_name!r}: a key of {row_size(cache_name, key)} bytes is over "
                f"the {MAX_ROW_BYTES}-byte row limit"
            )
        return key

    def _check_name(self, cache_name: str, *, pseudo: bool = False) -> None:
        """A name `invalidate*` may write: a pseudo-cache's only when `pseudo`."""
        _check_string(cache_name)
        if not pseudo and cache_name in self._expanders:
            raise ConfigError(
                f"{cache_name!r} is a pseudo-cache: invalidate it with invalidate_batch"
            )

    @staticmethod
    def _tuple(cache_name: str, keys: Any, what: str) -> Key:
        if isinstance(keys, tuple):
            return keys
        if isinstance(keys, list):
            return tuple(keys)
        raise CacheKeyError(
            f"cache {cache_name!r}: the {what} must be a tuple of the function's arguments, "
            f"such as ({keys!r},), not {type(keys).__name__}"
        )

    async def _write(self, txn: Transaction | None, rows: list[Invalidation]) -> None:
        if not rows:
            return
        if txn is None:
            async with self._database().transaction() as own:
                self._add_rows(own, rows)
            return
        self._add_rows(txn, rows)

    def _add_rows(self, txn: Transaction, rows: list[Invalidation]) -> None:
        txn.check_open()
        pending = self._pending.get(txn)
        if pending is None:
            gen = self._generator()
            pending = _Pending(self, rows)
            gen.insert_with_commit(txn, INSERT_ROWS, pending.params)
            self._pending[txn] = pending
            txn.call_after(pending.committed, first=True)
            txn.call_on_exception(pending.failed)
        else:
            pending.rows.extend(rows)

    def _generator(self) -> MultiWriterIdGenerator:
        if self._gen is None:
            raise ConfigError(
                "cache invalidation needs a started instance with caches enabled "
                "(caches.enabled in the configuration)"
            )
        return self._gen

    def _database(self) -> Database:
        self._generator()
        assert self._db is not None
        return self._db

    # -- applying -----------------------------------------------------------------------

    def on_rows(self, stream: str, writer: str, token: int, rows: list[Invalidation]) -> None:
        """The `caches` stream's rows listener (runs before its position moves)."""
        self.apply(rows)

    def apply(self, invalidations: Iterable[Invalidation]) -> None:
        """Invalidate the caches these rows name; expand pseudo-caches; ignore the rest."""
        caches = self._caches
        applied: collections.Counter[str] = collections.Counter()
        ignored: collections.Counter[str] = collections.Counter()
        for invalidation in invalidations:
            name = invalidation.cache_name
            cache = caches.get(name)
            if cache is not None:
                if invalidation.keys is None:
                    cache.invalidate_all()
                else:
                    cache.invalidate(invalidation.keys)
                applied[name] += 1
            elif name in self._expanders:
                self._expand(invalidation)
            else:
                ignored[name] += 1
        metrics = self.metrics
        for name, count in applied.items():
            metrics.child(metrics.invalidations_applied, name).inc(count)
        for name, count in ignored.items():
            metrics.child(metrics.invalidations_ignored, name).inc(count)

    def _expand(self, row: Invalidation) -> None:
        name, keys = row
        try:
            if keys is None or not keys or not isinstance(keys[-1], tuple):
                raise ValueError(f"expected (*shared, items), got {keys!r}")
            expanded = [
                Invalidation(cache_name, None if k is None else self._tuple(cache_name, k, "key"))
                for cache_name, k in self._expanders[name](*keys)
            ]
        except Exception:
            # Which entries it meant is unknown: drop everything rather than keep any
            # entry stale.
            logger.exception(
                "caches: expanding pseudo-cache %r with %r failed; clearing every cache", name, keys
            )
            for cache in self._caches.values():
                cache.invalidate_all()
            return
        real: list[Invalidation] = []
        for invalidation in expanded:
            if invalidation.cache_name in self._expanders:
                logger.error(
                    "caches: pseudo-cache %r expanded into pseudo-cache %r, which is not "
                    "expanded again; yield real cache names",
                    name,
                    invalidation.cache_name,
                )
            else:
                real.append(invalidation)
        self.apply(real)

    def _snapshots(self) -> list[CacheSnapshot]:
        return [
            CacheSnapshot(c.name, len(c), c.max_entries, c.hits, c.misses, c.evictions)
            for c in self._caches.values()
        ]


def _check_string(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a cache name must be a non-empty string, not {name!r}")


def _may_be_long(key: Key) -> bool:
    """Whether the key's JSON could reach the row limit (worth measuring exactly): JSON
    writes a character as at most 12 bytes (a surrogate pair of \\uXXXX escapes), a
    number or literal in at most 24."""
    estimate = 0
    for part in key:
        if isinstance(part, str):
            estimate += 12 * len(part) + 3
        elif isinstance(part, tuple):
            return True
        else:
            estimate += 25
    return estimate > MAX_ROW_BYTES // 2


class _Pending:
    """The invalidation rows of one transaction: written with its COMMIT, applied here
    once it committed (or, when its outcome is unknown, anyway: an extra invalidation
    costs a reload, a missing one serves stale data)."""

    __slots__ = ("_registry", "rows", "sent")

    def __init__(self, registry: CacheRegistry, rows: list[Invalidation]) -> None:
        self._registry = registry
        self.rows = list(rows)
        self.sent = False

    def params(self) -> Params:
        self.sent = True
        return (self._registry.instance_name, as_rows(self.rows))

    def committed(self) -> None:
        registry = self._registry
        registry.apply(self.rows)
        metrics = registry.metrics
        sent = collections.Counter(row.cache_name for row in self.rows)
        for name, count in sent.items():
            metrics.child(metrics.invalidations_sent, name).inc(count)

    def failed(self) -> None:
        if self.sent:
            self._registry.apply(self.rows)
