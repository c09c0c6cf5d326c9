"""Caches across instances (SPEC §7) on a real PostgreSQL and a real Redis or TCP hub:
invalidations written with the change, applied here after commit and everywhere else
before anyone observes their position, caught up after a disconnect, cleaned up."""

from __future__ import annotations

import asyncio
import collections
import json
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest

from plait import Database, StateError
from plait.caches.cleanup import InvalidationCleanup
from plait.caches.invalidations import CACHES_STREAM
from plait.instance import Instance
from plait.streams.outbox import Outbox
from redis_server import RedisServer
from replication_helpers import Cluster, cluster_of, connected, metric

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["redis", "tcp"])
async def cluster(request: pytest.FixtureRequest, db: Database) -> AsyncIterator[Cluster]:
    await create_kv(db)
    url = request.getfixturevalue("redis_url") if request.param == "redis" else ""
    async with cluster_of(db, request.param, redis_url=url, hub="hub") as cluster:
        yield cluster


async def create_kv(db: Database, keys: int = 20) -> None:
    async with db.connection() as conn:
        await conn.execute("CREATE TABLE kv (key TEXT PRIMARY KEY, value INT NOT NULL)")
        await conn.execute(
            "INSERT INTO kv SELECT 'k' || g, 0 FROM generate_series(0, %s) g", (keys - 1,)
        )


class App:
    """What each instance of the tests' application caches: values of `kv` (loaded
    from the database, loads counted), and plain caches behind a pseudo-cache."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.loads: collections.Counter[str] = collections.Counter()
        caches = instance.caches

        @caches.cached(name="value")
        async def value(key: str) -> int:
            self.loads[key] += 1
            async with instance.db.connection() as conn:
                cur = await conn.execute("SELECT value FROM kv WHERE key = %s", (key,))
                row = await cur.fetchone()
            assert row is not None
            return int(row[0])

        self.value = value
        self.members = caches.cache("members")
        self.rooms_for = caches.cache("rooms_for")

        @caches.pseudo_cache("room_changed")
        def room_changed(room: str, users: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
            yield ("members", (room,))
            for user in users:
                yield ("rooms_for", (user,))

    def fill(self, rooms: int = 3, users: int = 300) -> None:
        for r in range(rooms):
            self.members.set((f"!r{r}",), [f"@u{u}" for u in range(users)])
        for u in range(users):
            self.rooms_for.set((f"@u{u}",), [f"!r{r}" for r in range(rooms)])


async def start(cluster: Cluster, name: str, **overrides: Any) -> tuple[Instance, App]:
    instance = cluster.instance(name, **overrides)
    app = App(instance)
    return await cluster.start(instance), app


async def hub_if_tcp(cluster: Cluster) -> None:
    if cluster.transport == "tcp":
        await cluster.start(cluster.instance("hub"))


async def seen_by(reader: Instance, writer: Instance) -> None:
    """Until `reader` has seen everything `writer` wrote to the caches stream."""
    position = writer.own_positions()[CACHES_STREAM]
    assert await reader.wait_for_stream_position(writer.name, CACHES_STREAM, position, 10)


async def bump(txn: Any, key: str) -> None:
    await txn.execute("UPDATE kv SET value = value + 1 WHERE key = %s", (key,))


async def test_single_bulk_all_and_pseudo_invalidations_reach_the_other_instance(
    cluster: Cluster,
) -> None:
    await hub_if_tcp(cluster)
    a, app_a = await start(cluster, "w1")
    b, app_b = await start(cluster, "w2")
    await connected(a, b)
    for key in ("k0", "k1", "k2", "k3", "k4"):
        assert await app_b.value(key) == 0
    app_b.fill()
    loads_before = app_b.loads.copy()

    # One key, in the transaction that changes it.
    async with a.db.transaction() as txn:
        await bump(txn, "k0")
        await a.caches.invalidate(txn, "value", ("k0",))
    await seen_by(b, a)
    assert await app_b.value("k0") == 1
    assert app_b.loads["k0"] == loads_before["k0"] + 1
    for key in ("k1", "k2", "k3", "k4"):  # not invalidated: still cached, not reloaded
        assert await app_b.value(key) == 0
        assert app_b.loads[key] == loads_before[key]

    # Several keys at once.
    async with a.db.transaction() as txn:
        for key in ("k1", "k2"):
            await bump(txn, key)
        await a.caches.invalidate_bulk(txn, "value", [("k1",), ("k2",)])
    await seen_by(b, a)
    assert [await app_b.value(k) for k in ("k1", "k2", "k3")] == [1, 1, 0]
    assert app_b.loads["k3"] == loads_before["k3"]

    # One room's state changed: one pseudo-cache row for 300 members (split in parts).
    async with a.db.transaction() as txn:
        await a.caches.invalidate_batch(
            txn, "room_changed", ("!r1",), [f"@u{u}" for u in range(0, 300, 2)]
        )
    await seen_by(b, a)
    assert set(app_b.members.keys()) == {("!r0",), ("!r2",)}
    assert set(app_b.rooms_for.keys()) == {(f"@u{u}",) for u in range(1, 300, 2)}

    # Everything in one cache.
    async with a.db.transaction() as txn:
        await bump(txn, "k3")
        await a.caches.invalidate_all(txn, "value")
    await seen_by(b, a)
    assert len(app_b.value.cache) == 0
    assert await app_b.value("k3") == 1
    assert len(app_b.rooms_for) == 150  # other caches untouched

    # The writer's own caches were invalidated after each commit, without replication.
    assert await app_a.value("k0") == 1
    async with a.db.connection() as conn:
        cur = await conn.execute(
            "SELECT cache_name, count(*) FROM cache_invalidations GROUP BY 1 ORDER BY 1"
        )
        rows: dict[str, int] = dict(await cur.fetchall())
    assert rows["value"] == 4
    assert 1 <= rows["room_changed"] <= 3  # one row per part, not one per member
    sent = a.metrics.registry.get_sample_value
    assert sent("plait_cache_invalidations_sent_total", {"cache": "value"}) == 4
    applied = b.metrics.registry.get_sample_value
    assert applied("plait_cache_invalidations_applied_total", {"cache": "rooms_for"}) == 150
    text = b.metrics.render().decode()
    assert 'plait_cache_size{cache="rooms_for"} 150.0' in text
    assert 'plait_cache_hits_total{cache="value"}' in text


async def test_a_pseudo_cache_row_is_split_below_the_line_limit(cluster: Cluster) -> None:
    await hub_if_tcp(cluster)
    a, _ = await start(cluster, "w1")
    b, app_b = await start(cluster, "w2")
    await connected(a, b)
    users = [f"@user-with-a-rather-long-name-{u}:example.org" for u in range(5000)]
    for user in users:
        app_b.rooms_for.set((user,), ["!big"])
    async with a.db.transaction() as txn:
        await a.caches.invalidate_batch(txn, "room_changed", ("!big",), users)
    await seen_by(b, a)
    assert len(app_b.rooms_for) == 0
    async with a.db.connection() as conn:
        cur = await conn.execute("SELECT keys FROM cache_invalidations")
        stored = [row[0] for row in await cur.fetchall()]
    parts = len(stored)
    longest = max(len(json.dumps(keys, separators=(",", ":")).encode()) for keys in stored)
    assert parts >= 4  # ~250 KB of names in rows of at most 64 KiB
    assert longest <= 64 * 1024
    # Every part travelled live; none had to be read back.
    assert (
        b.metrics.registry.get_sample_value("plait_rdata_rows_total", {"stream": CACHES_STREAM})
        == parts
    )


async def test_rollback_writes_and_invalidates_nothing(db: Database, redis_url: str) -> None:
    await create_kv(db)
    async with cluster_of(db, "redis", redis_url=redis_url) as cluster:
        a, app_a = await start(cluster, "w1")
        assert await app_a.value("k0") == 0

        async def change_mind() -> None:
            async with a.db.transaction() as txn:
                await bump(txn, "k0")
                await a.caches.invalidate(txn, "value", ("k0",))
                raise RuntimeError("changed my mind")

        with pytest.raises(RuntimeError):
            await change_mind()
        assert ("k0",) in app_a.value.cache
        # A statement that fails at COMMIT (a deferred constraint) rolls back both.
        async with a.db.connection() as conn:
            await conn.execute(
                "CREATE TABLE strict (id INT PRIMARY KEY DEFERRABLE INITIALLY DEFERRED)"
            )

        async def violate_at_commit() -> None:
            async with a.db.transaction() as txn:
                await txn.execute("INSERT INTO strict VALUES (1), (1)")
                await a.caches.invalidate(txn, "value", ("k1",))

        with pytest.raises(psycopg.errors.UniqueViolation):
            await violate_at_commit()
        async with a.db.connection() as conn:
            cur = await conn.execute("SELECT count(*) FROM cache_invalidations")
            assert await cur.fetchone() == (0,)  # neither was written
        async with a.db.transaction() as ended:
            await a.caches.invalidate(ended, "value", ("k2",))
        with pytest.raises(StateError, match="ended already"):
            await a.caches.invalidate(ended, "value", ("k3",))  # would be lost
        # Nothing is left in flight: the next invalidation completes and moves on.
        gen = a.generator(CACHES_STREAM)
        await a.caches.invalidate(None, "value", ("k0",))
        assert gen.get_minimal_local_current_token() > 1
        assert ("k0",) not in app_a.value.cache
        assert gen.get_current_token_for_writer("w1") == gen.get_minimal_local_current_token()


async def test_local_caches_are_invalidated_before_the_transactions_ids_complete(
    db: Database, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another stream written in the same transaction: by the time its position moves
    here, the cache entry is gone already (R-CA-3 on the writer itself)."""
    await create_kv(db)
    async with cluster_of(db, "redis", redis_url=redis_url) as cluster:
        a, app_a = await start(cluster, "w1")
        assert await app_a.value("k5") == 0
        observed: list[bool] = []
        events = a.generator("events")
        # The moment its position moves is the moment it posts that to its outbox.
        post = Outbox.moved

        def moved(outbox: Outbox) -> None:
            if outbox is events.outbox:
                observed.append(("k5",) in app_a.value.cache)
            post(outbox)

        monkeypatch.setattr(Outbox, "moved", moved)
        async with a.db.transaction() as txn:
            stream_id = await events.get_next_txn(txn)
            await txn.execute("INSERT INTO events VALUES (%s, 'w1', 'x')", (stream_id,))
            await bump(txn, "k5")
            await a.caches.invalidate(txn, "value", ("k5",))
        assert observed == [False]
        assert await app_a.value("k5") == 1


async def test_no_listener_or_waiter_observes_a_position_before_its_invalidations(
    cluster: Cluster,
) -> None:
    """Four writers, four tasks each, change keys and invalidate them concurrently. On
    the reader, whenever a position of the caches stream becomes observable (position
    listeners, wait_for_stream_position), every key invalidated at or below it must be
    out of the cache already."""
    await hub_if_tcp(cluster)
    names = ["w1", "w2", "r", "x1"]
    writers = [await start(cluster, name) for name in names]
    reader_instance = cluster.instance("reader")
    reader_app = App(reader_instance)
    # Snapshots taken at each observation: (writer, position, keys still cached).
    observations: list[tuple[str, int, frozenset[Any]]] = []

    def on_position(stream: str, writer: str, token: int) -> None:
        observations.append((writer, token, frozenset(reader_app.value.cache.keys())))

    reader_instance.on_position(CACHES_STREAM, on_position)
    reader = await cluster.start(reader_instance)
    await connected(reader, *(instance for instance, _ in writers))
    keys = [f"w{n}-{i}" for n in range(len(names)) for i in range(60)]
    async with cluster.db.connection() as conn:
        await conn.execute("INSERT INTO kv SELECT unnest(%s::text[]), 0", (keys,))
    for key in keys:
        await reader_app.value(key)
    assert len(reader_app.value.cache) == len(keys)
    waited: list[tuple[str, bool]] = []

    async def waiter(writer: Instance, key: str, position: int) -> None:
        await reader.wait_for_stream_position(writer.name, CACHES_STREAM, position, 10)
        waited.append((key, (key,) in reader_app.value.cache))

    waiters: list[asyncio.Task[None]] = []

    async def write(n: int, instance: Instance, part: int) -> None:
        rng = random.Random(n * 10 + part)
        for i in range(part, 60, 4):
            key = f"w{n}-{i}"
            async with instance.db.transaction() as txn:
                await bump(txn, key)
                await asyncio.sleep(rng.random() * 0.005)  # commits interleave
                await instance.caches.invalidate(txn, "value", (key,))
            position = instance.own_positions()[CACHES_STREAM]
            waiters.append(asyncio.create_task(waiter(instance, key, position)))

    await asyncio.gather(
        *(write(n, instance, part) for n, (instance, _) in enumerate(writers) for part in range(4))
    )
    await asyncio.gather(*waiters)
    for instance, _ in writers:
        await seen_by(reader, instance)
    assert len(reader_app.value.cache) == 0  # every key was invalidated

    # Which key each caches-stream ID invalidated, per writer.
    async with cluster.db.connection() as conn:
        cur = await conn.execute(
            "SELECT instance_name, stream_id, keys->>0 FROM cache_invalidations"
        )
        rows = await cur.fetchall()
    assert len(rows) == len(keys)
    by_writer: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for writer, stream_id, key in rows:
        by_writer[writer].append((stream_id, key))
    assert len(observations) > 20
    for writer, position, cached in observations:
        stale = [
            key
            for stream_id, key in by_writer[writer]
            if stream_id <= position and (key,) in cached
        ]
        assert not stale, (writer, position, stale)
    assert len(waited) == len(keys)
    assert [key for key, still_cached in waited if still_cached] == []


async def test_a_reader_catches_up_invalidations_it_missed_while_disconnected(
    db: Database, redis_server: RedisServer
) -> None:
    await create_kv(db)
    async with cluster_of(
        db, "redis", redis_url=redis_server.url, catch_up_page_max=100
    ) as cluster:
        a, _ = await start(cluster, "w1")
        b, app_b = await start(cluster, "w2")
        await connected(a, b)
        for i in range(20):
            await app_b.value(f"k{i}")
        app_b.fill(users=50)
        async with a.db.transaction() as txn:
            await a.caches.invalidate(txn, "value", ("k0",))
        await seen_by(b, a)
        redis_server.stop()
        async with a.db.transaction() as txn:
            for i in range(1, 10):
                await bump(txn, f"k{i}")
            await a.caches.invalidate_bulk(txn, "value", [(f"k{i}",) for i in range(1, 10)])
        for i in range(120):  # more than a catch-up page
            await a.caches.invalidate(None, "rooms_for", (f"@u{i % 50}",))
        await a.caches.invalidate_batch(None, "room_changed", ("!r2",), [])
        redis_server.start()
        await seen_by(b, a)
        assert [await app_b.value(f"k{i}") for i in range(12)] == [0] + [1] * 9 + [0, 0]
        assert app_b.loads["k10"] == 1  # never invalidated: never reloaded
        assert len(app_b.rooms_for) == 0
        assert set(app_b.members.keys()) == {("!r0",), ("!r1",)}
        assert metric(b, "plait_catch_up_rows_total", stream=CACHES_STREAM) >= 130


async def test_cleanup_deletes_only_old_rows_in_batches_and_a_lagging_reader_keeps_its_rows(
    db: Database, redis_server: RedisServer
) -> None:
    """2 500 rows older than the retention go in batches of 1 000 (the first two runs
    report more to come); the rows within the retention stay, and a reader that was
    disconnected meanwhile still catches them up."""
    await create_kv(db)
    caches_config = {"cleanup": False}
    async with cluster_of(db, "redis", redis_url=redis_server.url) as cluster:
        a, _ = await start(cluster, "w1", caches=caches_config)
        b, app_b = await start(cluster, "w2", caches=caches_config)
        await connected(a, b)
        app_b.fill(users=10)
        for part in range(5):
            await a.caches.invalidate_bulk(None, "other", [(f"{part}-{i}",) for i in range(500)])
        async with db.connection() as conn:
            await conn.execute(
                "UPDATE cache_invalidations SET invalidation_ts = now() - interval '8 days'"
            )
        redis_server.stop()  # b lags from here on
        await a.caches.invalidate_bulk(None, "rooms_for", [(f"@u{u}",) for u in range(10)])
        cleanup = InvalidationCleanup(db, retention=7 * 24 * 3600.0, batch=1000)
        runs = [await cleanup.clean_once() for _ in range(4)]
        assert [(r.deleted, r.more) for r in runs if r is not None] == [
            (1000, True),
            (1000, True),
            (500, False),
            (0, False),
        ]
        async with db.connection() as conn:
            cur = await conn.execute(
                "SELECT cache_name, count(*) FROM cache_invalidations GROUP BY 1"
            )
            assert await cur.fetchall() == [("rooms_for", 10)]
        redis_server.start()
        await seen_by(b, a)
        assert len(app_b.rooms_for) == 0  # caught up from the rows the cleanup kept


async def test_one_cleaner_at_a_time(db: Database) -> None:
    first = InvalidationCleanup(db)
    async with db.transaction() as txn:
        await txn.execute("SELECT pg_advisory_xact_lock(%s)", (0x706C616974_02,))
        assert await first.clean_once() is None  # someone else holds the lock
    assert await first.clean_once() is not None


async def test_a_starting_instance_waits_for_an_invalidation_on_its_way_to_commit(
    db: Database, redis_url: str
) -> None:
    """A caches row with a smaller ID than the table's largest is still committing when
    an instance starts. Starting past it would lose that invalidation; the instance
    waits for it instead, so what it caches afterwards is read after that commit."""
    await create_kv(db)
    async with cluster_of(db, "redis", redis_url=redis_url) as cluster:
        a, _ = await start(cluster, "w1")
        async with await psycopg.AsyncConnection.connect(db.dsn) as slow:
            # The change and its invalidation, taken before the next one but not
            # committed yet (as inside COMMIT's round trip).
            await slow.execute("UPDATE kv SET value = 1 WHERE key = 'k0'")
            await slow.execute(
                "INSERT INTO cache_invalidations (stream_id, instance_name, cache_name, keys)"
                " VALUES (nextval('cache_invalidations_seq'), 'w1', 'value', '[\"k0\"]')"
            )
            await a.caches.invalidate(None, "value", ("k1",))  # a larger ID, committed
            b_instance = cluster.instance("w2")
            app_b = App(b_instance)

            async def start_and_read() -> int:
                await cluster.start(b_instance)
                return await app_b.value("k0")  # as soon as it can

            starting = asyncio.create_task(start_and_read())
            await asyncio.sleep(0.5)
            assert not starting.done()  # waiting for the row in flight
            await slow.commit()
        assert await starting == 1
        await seen_by(b_instance, a)
        assert await app_b.value("k0") == 1
