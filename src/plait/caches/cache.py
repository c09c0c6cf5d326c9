"""`Cache`: a bounded LRU map whose loads are shared and never outlive an invalidation.

Two callers missing the same key share one load. An invalidation that arrives while a
load is running drops that load's result instead of storing it: the load may have read
the data before the change that caused the invalidation, and storing it would serve
stale data until the next change. (Callers already waiting for that load still get its
result: they asked before the invalidation.)

Plain `collections.OrderedDict` rather than a cache library: the LRU is a few lines,
and what matters here, the loads and their interplay with invalidations, no library
offers.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from plait.caches.invalidations import Key, check_key
from plait.errors import CacheKeyError, ConfigError

V = TypeVar("V")
DEFAULT_MAX_ENTRIES = 10_000
_MISSING: Any = object()


class Cache(Generic[V]):
    """One named cache: `max_entries` values by key tuple, least recently used first out."""

    def __init__(self, name: str, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a cache needs a non-empty name, not {name!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigError(f"cache {name!r}: max_entries must be a positive int")
        self.name = name
        self.max_entries = max_entries
        self._entries: OrderedDict[Key, V] = OrderedDict()
        self._loading: dict[Key, asyncio.Future[V]] = {}
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def get(self, key: Key, default: Any = None) -> V | Any:
        """The cached value (counted as a hit), or `default` (a miss)."""
        try:
            value = self._entries[key]
        except KeyError:
            self.misses += 1
            return default
        except TypeError:
            raise _unhashable(self.name, key) from None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def set(self, key: Key, value: V) -> None:
        """Store a value. Prefer `get_or_load`: a value read before a concurrent change
        and stored after its invalidation stays stale."""
        check_key(key, self.name)
        self._store(key, value)

    async def get_or_load(self, key: Key, load: Callable[[], Awaitable[V]]) -> V:
        """The cached value, or the result of `load()` (stored unless invalidated
        meanwhile). Concurrent misses of one key share one load; a failed load stores
        nothing and fails every caller waiting for it."""
        entries = self._entries
        try:
            value = entries[key]
        except KeyError:
            pass
        except TypeError:
            raise _unhashable(self.name, key) from None
        else:
            entries.move_to_end(key)
            self.hits += 1
            return value
        pending = self._loading.get(key)
        if pending is None:
            check_key(key, self.name)
            self.misses += 1
            # A task of its own: a caller that is cancelled does not cancel the load
            # others wait for.
            pending = asyncio.ensure_future(load())
            self._loading[key] = pending
            pending.add_done_callback(lambda done: self._loaded(key, done))
        else:
            self.hits += 1
        return await asyncio.shield(pending)

    def _loaded(self, key: Key, done: asyncio.Future[V]) -> None:
        if self._loading.get(key) is not done:
            if not done.cancelled():
                done.exception()  # mark it retrieved: the waiters saw it
            return  # invalidated while loading: do not store what it read
        del self._loading[key]
        if not done.cancelled() and done.exception() is None:
            self._store(key, done.result())

    def _store(self, key: Key, value: V) -> None:
        entries = self._entries
        entries[key] = value
        entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
            self.evictions += 1

    def invalidate(self, key: Key) -> None:
        """Drop `key`, and the result of a load of it now running."""
        try:
            self._entries.pop(key, None)
            self._loading.pop(key, None)
        except TypeError:
            pass  # an unhashable key was never stored

    def invalidate_all(self) -> None:
        """Drop every entry, and the results of every load now running."""
        self._entries.clear()
        self._loading.clear()

    def keys(self) -> list[Key]:
        return list(self._entries)

    def __repr__(self) -> str:
        return f"<Cache {self.name!r} {len(self)}/{self.max_entries}>"


def _unhashable(name: str, key: Key) -> CacheKeyError:
    return CacheKeyError(
        f"cache {name!r}: key {key!r} is not hashable; cache keys are tuples of str, "
        "int, float, bool, None or tuples of them"
    )
