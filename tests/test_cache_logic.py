"""Caches without I/O: the LRU and its loads, keys, pseudo-cache rows, applying rows."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from plait.caches.cache import Cache
from plait.caches.cached import CachedFunction
from plait.caches.cleanup import Batch, next_delay
from plait.caches.invalidations import (
    MAX_ROW_BYTES,
    Invalidation,
    InvalidationRows,
    as_rows,
    check_key,
    freeze,
    keys_json,
    row_size,
    split_items,
)
from plait.caches.registry import CacheRegistry, _may_be_long
from plait.errors import CacheKeyError, ConfigError
from plait.replication.metrics import ReplicationMetrics

json_scalars = (
    st.text(max_size=8)
    | st.integers(-(2**53), 2**53)
    | st.booleans()
    | st.none()
    | st.floats(allow_nan=False, allow_infinity=False)
)
key_parts = st.recursive(json_scalars, lambda inner: st.tuples(inner, inner), max_leaves=4)
keys = st.lists(key_parts, max_size=4).map(tuple)


# -- Cache ---------------------------------------------------------------------------------


def test_lru_keeps_the_most_recently_used_entries() -> None:
    cache: Cache[int] = Cache("c", max_entries=3)
    for i in range(3):
        cache.set((i,), i)
    assert cache.get((0,)) == 0  # 0 is now the most recent
    cache.set((3,), 3)
    assert cache.keys() == [(2,), (0,), (3,)]
    assert (cache.hits, cache.misses, cache.evictions) == (1, 0, 1)
    assert cache.get((1,), "gone") == "gone"
    assert cache.misses == 1


async def test_concurrent_misses_share_one_load() -> None:
    cache: Cache[str] = Cache("c")
    loads = 0
    release = asyncio.Event()

    async def load() -> str:
        nonlocal loads
        loads += 1
        await release.wait()
        return "v"

    waiting = [asyncio.create_task(cache.get_or_load(("k",), load)) for _ in range(5)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(*waiting) == ["v"] * 5
    assert loads == 1
    assert await cache.get_or_load(("k",), load) == "v"
    assert (loads, cache.misses, cache.hits) == (1, 1, 5)


async def test_an_invalidation_during_a_load_keeps_its_result_out_of_the_cache() -> None:
    """The load may have read the data before the change: storing it would serve stale
    data until the next change."""
    cache: Cache[str] = Cache("c")
    release = asyncio.Event()

    async def old() -> str:
        await release.wait()
        return "old"

    first = asyncio.create_task(cache.get_or_load(("k",), old))
    await asyncio.sleep(0)
    cache.invalidate(("k",))

    async def new() -> str:
        return "new"

    # A caller after the invalidation does not join the old load.
    assert await cache.get_or_load(("k",), new) == "new"
    release.set()
    assert await first == "old"  # asked before the invalidation
    assert cache.get(("k",)) == "new"

    second = asyncio.create_task(cache.get_or_load(("j",), old))
    release.clear()
    await asyncio.sleep(0)
    cache.invalidate_all()
    release.set()
    assert await second == "old"
    assert ("j",) not in cache


async def test_a_failed_load_fails_its_callers_and_stores_nothing() -> None:
    cache: Cache[str] = Cache("c")

    async def broken() -> str:
        raise RuntimeError("database down")

    with pytest.raises(RuntimeError, match="database down"):
        await cache.get_or_load(("k",), broken)
    assert len(cache) == 0

    async def fine() -> str:
        return "v"

    assert await cache.get_or_load(("k",), fine) == "v"


async def test_a_cancelled_caller_does_not_cancel_the_load_others_wait_for() -> None:
    cache: Cache[str] = Cache("c")
    release = asyncio.Event()

    async def load() -> str:
        await release.wait()
        return "v"

    first = asyncio.create_task(cache.get_or_load(("k",), load))
    second = asyncio.create_task(cache.get_or_load(("k",), load))
    await asyncio.sleep(0)
    first.cancel()
    release.set()
    assert await second == "v"
    assert cache.get(("k",)) == "v"


def test_keys_that_would_not_survive_json_are_refused() -> None:
    import uuid

    cache: Cache[int] = Cache("users")
    with pytest.raises(CacheKeyError, match="str\\(uuid\\)"):
        cache.set((uuid.uuid4(),), 1)
    with pytest.raises(CacheKeyError, match="not hashable"):
        cache.get(([1, 2],))
    with pytest.raises(CacheKeyError):
        check_key((float("nan"),), "c")


@given(keys)
def test_keys_read_back_equal_after_a_trip_through_json(key: tuple[Any, ...]) -> None:
    check_key(key, "c")
    assert freeze(json.loads(keys_json(key))) == key
    codec = InvalidationRows()
    row = Invalidation("c", key)
    assert codec.from_json(json.loads(json.dumps(codec.to_json(row)))) == row


def test_bad_rows_from_the_wire_are_refused_clearly() -> None:
    codec = InvalidationRows()
    for bad in ({"c": 1}, ["c"], [1, []], ["c", "k"]):
        with pytest.raises(ValueError, match="cache name"):
            codec.from_json(bad)
    assert codec.from_json(["c", None]) == Invalidation("c", None)


# -- CachedFunction ------------------------------------------------------------------------


async def test_cached_function_keys_by_arguments_with_defaults_filled_in() -> None:
    calls: list[tuple[Any, ...]] = []

    async def get(user: str, room: str = "lobby", *, full: bool = False) -> str:
        calls.append((user, room, full))
        return f"{user}/{room}/{full}"

    cached = CachedFunction(get, Cache("get"))
    assert await cached("a") == "a/lobby/False"
    assert await cached("a", "lobby") == "a/lobby/False"
    assert await cached(user="a", full=False) == "a/lobby/False"
    assert await cached("a", full=True) == "a/lobby/True"
    assert len(calls) == 2
    assert cached.key("a") == ("a", "lobby", False)
    cached.cache.invalidate(("a", "lobby", False))
    await cached("a")
    assert len(calls) == 3
    with pytest.raises(TypeError, match="get"):
        await cached()  # type: ignore[call-arg]  # the missing argument is the point


def test_functions_with_variable_arguments_cannot_be_cached() -> None:
    async def anything(*args: Any) -> None:
        return None

    with pytest.raises(ConfigError, match=r"\*args"):
        CachedFunction(anything, Cache("x"))


# -- pseudo-cache rows -----------------------------------------------------------------------


@given(
    st.lists(st.text(max_size=30) | st.integers(), max_size=200),
    st.integers(min_value=60, max_value=1000),
)
def test_split_items_keeps_every_row_under_the_limit_and_every_item_once(
    items: list[Any], limit: int
) -> None:
    shared = ("!room:example.org",)
    head = len(b"room_changed") + len(keys_json((*shared, ())).encode())
    if any(head + len(json.dumps(item).encode()) + 1 > limit for item in items):
        with pytest.raises(ValueError, match="alone makes a row"):
            split_items("room_changed", shared, items, limit)
        return
    rows = split_items("room_changed", shared, items, limit)
    assert rows
    assert all(row[:-1] == shared for row in rows)
    assert [item for row in rows for item in row[-1]] == items
    for row in rows:
        assert len(b"room_changed") + len(keys_json(row).encode()) <= limit
    assert all(row[-1] for row in rows) or items == []


def test_split_items_refuses_what_cannot_fit() -> None:
    with pytest.raises(ValueError, match="alone makes a row"):
        split_items("p", ("r",), ["x" * 200], limit=100)
    with pytest.raises(ValueError, match="shared keys alone"):
        split_items("p", ("r" * 200,), [], limit=100)


# -- applying rows ---------------------------------------------------------------------------


def registry_with_caches() -> tuple[CacheRegistry, ReplicationMetrics]:
    metrics = ReplicationMetrics()
    registry = CacheRegistry("me", metrics)
    for name in ("members", "rooms_for", "other"):
        cache = registry.cache(name)
        for key in ("!a", "!b", "@u", "@v", "@w"):
            cache.set((key,), key)

    @registry.pseudo_cache("room_changed")
    def room_changed(room: str, members: tuple[str, ...]) -> Any:
        yield ("members", (room,))
        for member in members:
            yield ("rooms_for", (member,))

    return registry, metrics


def test_rows_invalidate_their_caches_expand_pseudo_caches_and_ignore_unknown_names() -> None:
    registry, metrics = registry_with_caches()
    registry.apply(
        [
            Invalidation("room_changed", ("!a", ("@u", "@v"))),
            Invalidation("other", ("@w",)),
            Invalidation("not_here", ("x",)),
        ]
    )
    assert registry["members"].keys() == [("!b",), ("@u",), ("@v",), ("@w",)]
    assert registry["rooms_for"].keys() == [("!a",), ("!b",), ("@w",)]
    assert registry["other"].keys() == [("!a",), ("!b",), ("@u",), ("@v",)]
    sample = metrics.registry.get_sample_value
    assert sample("plait_cache_invalidations_applied_total", {"cache": "rooms_for"}) == 2
    assert sample("plait_cache_invalidations_ignored_total", {"cache": "not_here"}) == 1
    registry.apply([Invalidation("other", None)])
    assert len(registry["other"]) == 0


def test_a_failing_expander_clears_every_cache_rather_than_leave_one_stale() -> None:
    registry, _ = registry_with_caches()
    registry.apply([Invalidation("room_changed", ("!a", "not a tuple"))])
    assert all(len(registry[name]) == 0 for name in ("members", "rooms_for", "other"))


def test_rows_for_the_insert_statement() -> None:
    rows = [Invalidation("c", ("a", 1)), Invalidation("d", None)]
    assert json.loads(as_rows(rows)) == [["c", ["a", 1]], ["d", None]]


async def test_invalidation_checks_names_keys_and_arity_before_writing() -> None:
    registry = CacheRegistry("me", ReplicationMetrics())

    @registry.cached()
    async def get_user(user_id: str) -> str:
        return user_id

    @registry.pseudo_cache("changed")
    def changed(x: str, items: tuple[str, ...]) -> Any:
        return []

    assert get_user.name == (
        "test_invalidation_checks_names_keys_and_arity_before_writing.<locals>.get_user"
    )
    with pytest.raises(CacheKeyError, match="keyed by 1 argument"):
        await registry.invalidate(None, get_user.name, ("a", "b"))
    with pytest.raises(CacheKeyError, match="tuple of the function's arguments"):
        await registry.invalidate(None, get_user.name, "a")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pseudo-cache"):
        await registry.invalidate(None, "changed", ("a",))
    with pytest.raises(ConfigError, match="not a pseudo-cache"):
        await registry.invalidate_batch(None, get_user.name, ("a",), [])
    with pytest.raises(ConfigError, match="exists already"):
        registry.cache(get_user.name)
    with pytest.raises(ConfigError, match="started instance"):
        await registry.invalidate(None, get_user.name, ("a",))


def test_cleanup_runs_again_soon_only_while_there_is_a_backlog() -> None:
    assert next_delay(Batch(1000, more=True), pause=0.1, interval=3600) == 0.1
    assert next_delay(Batch(10, more=False), pause=0.1, interval=3600) == 3600
    assert next_delay(None, pause=0.1, interval=3600) == 3600


@given(
    st.lists(
        st.text(max_size=20)
        | st.text(min_size=2000, max_size=6000)  # long enough for the limit, also escaped
        | st.integers()
        | st.floats(allow_nan=False),
        max_size=6,
    )
)
@example(["\U0001f600" * 3000])  # 12 bytes of JSON per character: measured
@example(["x" * 70_000])
def test_only_keys_that_may_be_long_are_measured(parts: list[Any]) -> None:
    """A key whose JSON nears the row limit is always measured exactly; short ones are
    let through without measuring."""
    key = tuple(parts)
    if row_size("c", key) > MAX_ROW_BYTES // 2:
        assert _may_be_long(key)
    if all(not isinstance(p, str) or len(p) < 100 for p in parts):
        assert not _may_be_long(key)
