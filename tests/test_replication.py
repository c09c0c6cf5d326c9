"""Replication end to end: instances on a real PostgreSQL, talking over a real Redis or
real TCP sockets. Every row reaches every other instance exactly once, in order,
through live RDATA or catch-up, across disconnects and restarts."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from redis.asyncio import Redis

import pace
from pace import scaled
from plait import Database
from plait.demo.presence import UserSync
from plait.instance import Instance
from plait.replication.rows import DictRows
from redis_server import RedisServer
from replication_helpers import (
    STREAMS,
    Cluster,
    Seen,
    cluster_of,
    connected,
    metric,
    write,
    write_many,
)
from stream_helpers import stored_positions

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def redis_cluster(db: Database, redis_server: RedisServer) -> AsyncIterator[Cluster]:
    """On a Redis server of the test's own, which the test may stop and start; catch-up
    pages stay at 100 rows."""
    async with cluster_of(
        db, "redis", redis_url=redis_server.url, catch_up_page_max=100
    ) as cluster:
        yield cluster


async def started(cluster: Cluster, name: str, seen: Seen | None = None) -> Instance:
    instance = cluster.instance(name)
    if seen is not None:
        instance.on_rows("events", seen.on_rows)
    return await cluster.start(instance)


async def test_live_rows_reach_other_instances_in_order_with_batches_together(
    cluster: Cluster,
) -> None:
    seen_r, seen_w1 = Seen(), Seen()
    instances = []
    if cluster.transport == "tcp":
        instances.append(await started(cluster, "hub"))
    w1 = await started(cluster, "w1", seen_w1)
    w2 = await started(cluster, "w2")
    r = await started(cluster, "r", seen_r)
    await connected(*instances, w1, w2, r)

    expected = []
    for i in range(10):
        sid = await write(w1, f"a{i}")
        expected.append(("events", sid, "w1", f"a{i}.0"))
    batch_id = await write(w1, "batch", rows=3)
    expected += [("events", batch_id, "w1", f"batch.{i}") for i in range(3)]
    for i in range(5):
        sid = await write(w2, f"b{i}")
        expected.append(("events", sid, "w2", f"b{i}.0"))

    await seen_r.wait(len(expected))
    assert sorted(seen_r.rows, key=lambda r: (r[1], r[3])) == sorted(
        expected, key=lambda r: (r[1], r[3])
    )
    for writer in ("w1", "w2"):  # in order per writer
        ids = [row[1] for row in seen_r.rows if row[2] == writer]
        assert ids == sorted(ids)
    batch_calls = [rows for _, token, rows in seen_r.calls if token == batch_id]
    assert batch_calls == [[("events", batch_id, "w1", f"batch.{i}") for i in range(3)]]
    # w1 sees w2's rows but never its own echoes.
    await seen_w1.wait(5)
    assert {row[2] for row in seen_w1.rows} == {"w2"}
    assert await r.wait_for_stream_position("w1", "events", batch_id, timeout=5)
    # Nothing repeated later: a row of each writer after all of the above. One
    # writer's rows arrive in order, so a repeat of an earlier row arrives before its
    # writer's last one, where the exact comparison below counts it.
    for instance, writer in ((w1, "w1"), (w2, "w2")):
        expected.append(("events", await write(instance, "last"), writer, "last.0"))
    await seen_r.wait(len(expected))
    assert sorted(seen_r.rows, key=lambda r: (r[1], r[3])) == sorted(
        expected, key=lambda r: (r[1], r[3])
    )


async def test_redis_restart_while_writers_write_every_row_arrives_exactly_once(
    redis_cluster: Cluster, redis_server: RedisServer
) -> None:
    """≥ 250 rows missed with a page size of 100; two tables merged under one upto."""
    seen = Seen()
    w1 = await started(redis_cluster, "w1")
    w2 = await started(redis_cluster, "w2")
    r = await started(redis_cluster, "r", seen)
    await connected(w1, w2, r)
    first = await write(w1, "before")
    await seen.wait(1)

    redis_server.stop()
    missed = [await write(w1, f"both{i}", both_tables=True) for i in range(30)]
    bulk = await write_many(w1, 260, "bulk")
    other = await write_many(w2, 40, "other")
    redis_server.start()
    live = await write(w2, "after")

    expected_count = 1 + 60 + 260 + 40 + 1
    await seen.wait(expected_count, within=30)
    await asyncio.sleep(0.5)
    rows = seen.rows
    assert len(rows) == expected_count == len(set(rows))  # exactly once
    ids = {row[1] for row in rows}
    assert ids == {first, live, *missed, *bulk, *other}
    for sid in missed:  # both tables' rows of every ID
        assert {row[0] for row in rows if row[1] == sid} == {"events", "events_extra"}
    for writer in ("w1", "w2"):
        order = [row[1] for row in rows if row[2] == writer]
        assert order == sorted(order)
    assert metric(r, "plait_catch_up_pages_total", stream="events") >= 3
    assert metric(r, "plait_catch_up_rows_total", stream="events") >= 300
    assert r.generator("events").get_positions()["w1"] >= bulk[-1]


def _most_attempts(window: float, first: float = 0.05, cap: float = 1.0) -> int:
    """Attempts that fit in `window` seconds when each waits the shortest its backoff
    allows (doubling from `first` up to `cap`, less its 20 % jitter), and two more."""
    spent, delay, attempts = 0.0, first, 0
    while spent <= window:
        spent += 0.8 * delay
        delay = min(2 * delay, cap)
        attempts += 1
    return attempts + 2


async def test_a_failure_during_catch_up_backs_off_and_then_catches_up(
    redis_cluster: Cluster, redis_server: RedisServer
) -> None:
    seen = Seen()
    w1 = await started(redis_cluster, "w1")
    r_instance = redis_cluster.instance("r")
    failing = {"on": False}
    codec = r_instance._codecs["events"]
    from_db = codec.from_db

    def flaky(row: Any) -> Any:
        if failing["on"]:
            raise OSError("injected: catch-up read failed")
        return from_db(row)

    codec.from_db = flaky  # type: ignore[method-assign]
    r_instance.on_rows("events", seen.on_rows)
    r = await redis_cluster.start(r_instance)
    await connected(w1, r)

    redis_server.stop()
    ids = await write_many(w1, 50, "missed")
    failing["on"] = True
    redis_server.start()
    before = metric(r, "plait_reconnects_total", link="redis")
    window = scaled(1.6)  # a busy machine makes each attempt slower, so fewer fit
    await asyncio.sleep(window)
    attempts = metric(r, "plait_reconnects_total", link="redis") - before
    # 0.05 s doubling up to the cluster's 1 s cap: a handful, never a tight loop.
    assert 2 <= attempts <= _most_attempts(window), attempts
    assert seen.rows == []
    failing["on"] = False
    await seen.wait(50, within=20)
    assert [row[1] for row in seen.rows] == ids
    await connected(r)


async def test_a_worker_whose_cancellation_was_swallowed_ends_with_its_connection(
    redis_cluster: Cluster, redis_server: RedisServer
) -> None:
    """A connection's inbound worker is cancelled when the connection ends. A library
    under a listener may swallow that (psycopg_pool on Python 3.11 can): the worker must
    still end once the listener returns, not wait on its dead connection's queue."""
    workers: list[asyncio.Task[Any]] = []
    released = asyncio.Event()

    async def stubborn(stream: str, writer: str, token: int, rows: list[Any]) -> None:
        if not workers:
            workers.append(asyncio.current_task())  # type: ignore[arg-type]
            try:
                await released.wait()
            except asyncio.CancelledError:  # swallowed, and the work goes on
                await released.wait()

    w1 = await started(redis_cluster, "w1")
    r_instance = redis_cluster.instance("r")
    r_instance.on_rows("events", stubborn)
    r = await redis_cluster.start(r_instance)
    await connected(w1, r)
    await write(w1, "held")
    await pace.until(lambda: bool(workers), 10, "r's on_rows to be called")
    async with Redis.from_url(redis_server.url) as admin:
        await admin.client_kill_filter(_type="pubsub")  # every instance's connection ends
    await asyncio.sleep(0.3)  # the worker was cancelled; the listener went on waiting
    assert not workers[0].done()
    released.set()
    await pace.until(workers[0].done, 2, "the released on_rows to end")
    await connected(w1, r)


async def test_a_reader_of_positions_alone_catches_up_without_reading_rows(
    redis_cluster: Cluster, redis_server: RedisServer
) -> None:
    """Rows missed while Redis was down are read from the database only by a process
    that hands them to someone: one that listens to positions alone moves on at once
    (it would read them and drop them, and fall behind by as long)."""
    seen = Seen()
    w1 = await started(redis_cluster, "w1")
    rows_reader = await started(redis_cluster, "r", seen)
    positions: list[int] = []
    p_instance = redis_cluster.instance("p")
    p_instance.on_position("events", lambda stream, writer, token: positions.append(token))
    p = await redis_cluster.start(p_instance)
    await connected(w1, rows_reader, p)
    redis_server.stop()
    ids = await write_many(w1, 250, "missed")
    redis_server.start()
    await seen.wait(250, within=20)
    assert [row[1] for row in seen.rows] == ids
    await pace.until(
        lambda: p.generator("events").get_current_token_for_writer("w1") >= ids[-1],
        10,
        f"p's position of w1 to reach {ids[-1]}",
    )
    assert metric(rows_reader, "plait_catch_up_rows_total", stream="events") == 250
    assert metric(p, "plait_catch_up_rows_total", stream="events") == 0
    assert metric(p, "plait_catch_up_pages_total", stream="events") == 0
    assert positions[-1] >= ids[-1]


async def test_stale_and_malformed_lines_change_nothing(redis_cluster: Cluster) -> None:
    seen = Seen()
    w1 = await started(redis_cluster, "w1")
    r = await started(redis_cluster, "r", seen)
    await connected(w1, r)
    sid = await write(w1, "x")
    await seen.wait(1)
    position = r.generator("events").get_positions()["w1"]
    publisher = aioredis.Redis.from_url(redis_cluster.redis_url)
    channel = r.config.channel
    try:
        for line in (
            f'RDATA events w1 {sid} ["events",{sid},"w1","again"]',  # stale: seen already
            f'RDATA events w1 {sid - 1} ["events",1,"w1","older"]',
            "RDATA events w1 notanumber []",
            "POSITION events w1 9",
            "\xff\xfe garbage",
        ):
            await publisher.publish(channel, line)
        await asyncio.sleep(0.3)
        assert len(seen.rows) == 1
        assert r.generator("events").get_positions()["w1"] == position
        assert metric(r, "plait_bad_command_lines_total", link="redis") >= 3
        await write(w1, "y")  # the connection still works
        await seen.wait(2)
    finally:
        await publisher.aclose()


async def test_an_idle_writer_lets_the_linear_position_advance(cluster: Cluster) -> None:
    announce = 0.5
    names = (["hub"] if cluster.transport == "tcp" else []) + ["w1", "w2", "r"]
    instances = {}
    for name in names:
        inst = cluster.instance(name, replication={"announce_interval": announce})
        instances[name] = await cluster.start(inst)
    await connected(*instances.values())
    w1, r = instances["w1"], instances["r"]
    last = 0
    for i in range(5):
        last = await write(w1, f"busy{i}")
        await asyncio.sleep(0.05)
    done = time.monotonic()
    gen = r.generator("events")
    await pace.until(
        lambda: gen.get_persisted_upto_position() >= last,
        5,
        f"r's persisted-up-to position to reach {last}",
        every=0.005,
    )
    elapsed = time.monotonic() - done
    # One announce, not the 1 s refresh, whatever the machine's pace.
    assert elapsed <= min(scaled(announce + 0.1), 0.95), elapsed


async def test_an_idle_writer_whose_listener_lags_still_follows_the_others(
    cluster: Cluster,
) -> None:
    """w2 writes nothing, and its own `on_rows` is slow: replication moves its view of
    w1 only at its listener's pace. Its idle position follows w1's stored position all
    the same (R-ID-5, R-ID-8), or every reader's linear position would lag by w2's
    listener (before: it reached w1's last ID only as its listener got there)."""
    others = [await started(cluster, "hub")] if cluster.transport == "tcp" else []
    w1 = await started(cluster, "w1")
    heard: list[int] = []

    async def slowly(stream: str, writer: str, token: int, rows: list[Any]) -> None:
        await asyncio.sleep(0.05)
        heard.append(token)

    w2_instance = cluster.instance("w2")
    w2_instance.on_rows("events", slowly)
    w2 = await cluster.start(w2_instance)
    await connected(*others, w1, w2)

    ids = [await write(w1, f"x{i}") for i in range(150)]  # w2 hears them in >= 7.5 s

    async def stored() -> bool:  # what readers of the database follow
        return (await stored_positions(cluster.db)).get("w2", 0) >= ids[-1]

    await pace.until(stored, 60, "w2's stored idle position to reach w1's last ID")
    assert len(heard) < len(ids), "w2 got there only as its listener heard w1's last row"


async def test_wait_for_stream_position_and_read_your_writes(cluster: Cluster) -> None:
    seen_r = Seen()
    if cluster.transport == "tcp":
        await started(cluster, "hub")
    w1 = await started(cluster, "w1")
    r_instance = cluster.instance("r")
    r_instance.on_rows("events", seen_r.on_rows)

    async def bodies(args: Any) -> list[str]:
        return [row[3] for row in seen_r.rows if row[2] == args["writer"]]

    r_instance.register_endpoint("bodies", bodies)
    r = await cluster.start(r_instance)
    await connected(w1, r)

    sid = await write(w1, "mine")
    assert await r.wait_for_stream_position("w1", "events", sid, timeout=5)
    assert await r.wait_for_stream_position("r", "events", 10**9)  # self: at once
    # Above the sequence head no write can ever reach it: refused, not waited for.
    started_at = time.monotonic()
    assert not await r.wait_for_stream_position("w1", "events", sid + 1000, timeout=30)
    assert time.monotonic() - started_at < 30
    assert metric(r, "plait_refused_positions_total", stream="events") == 1
    assert metric(r, "plait_wait_timeouts_total", stream="events") == 0
    # IDs handed out and not written yet are waited for, up to the timeout.
    events, notes = w1.generator("events"), w1.generator("notes")
    async with events.get_next() as pending, notes.get_next() as pending_note:
        started_at = time.monotonic()
        assert not await r.wait_for_stream_position("w1", "events", pending, timeout=0.2)
        assert 0.2 <= time.monotonic() - started_at < scaled(1)
        assert metric(r, "plait_wait_timeouts_total", stream="events") == 1
        # Positions on several streams are awaited together: one timeout in all.
        started_at = time.monotonic()
        await r.await_positions("w1", {"events": pending, "notes": pending_note}, timeout=0.3)
        # One timeout for both, not two in turn, whatever the machine's pace.
        assert 0.3 <= time.monotonic() - started_at < min(0.3 + scaled(0.25), 0.59)
        assert metric(r, "plait_wait_timeouts_total", stream="notes") == 1

    for i in range(5):  # each call sees the write just before it
        await write(w1, f"ryw{i}")
        assert f"ryw{i}.0" in await w1.call("r", "bodies", {"writer": "w1"})


async def test_in_memory_stream_catches_up_over_http_and_detects_a_reset(
    cluster: Cluster,
) -> None:
    typing_rows: list[tuple[str, int, Any]] = []
    resets: list[str] = []
    departed: list[str] = []
    if cluster.transport == "tcp":
        await started(cluster, "hub")
    w1 = await started(cluster, "w1")
    typing = w1.memory("typing")
    typing.write("room1", {"room": "room1", "users": ["alice"]})
    typing.write("room2", {"room": "room2", "users": ["bob"]})
    typing.write("room1", {"room": "room1", "users": []})

    r_instance = cluster.instance("r")
    r_instance.on_rows(
        "typing", lambda s, w, t, rows: typing_rows.extend((w, t, row) for row in rows)
    )
    r_instance.on_reset("typing", lambda s, w: resets.append(w))
    r_instance.on_departure(departed.append)
    r = await cluster.start(r_instance)
    await connected(w1, r)
    # Caught up over HTTP: the latest row of each room, the first time as a reset.
    assert [row["users"] for _, _, row in typing_rows] == [["bob"], []]
    assert resets == ["w1"]
    token = typing.write("room3", {"room": "room3", "users": ["carol"]})
    assert await r.wait_for_stream_position("w1", "typing", token, timeout=5)
    assert typing_rows[-1][2]["users"] == ["carol"]

    await w1.stop()  # clean shutdown: peers hear of it at once
    await pace.until(lambda: departed == ["w1"], 5, "w1's departure")
    typing_rows.clear()
    w1_again = await started(cluster, "w1")
    w1_again.memory("typing").write("room9", {"room": "room9", "users": ["dan"]})
    await pace.until(lambda: bool(typing_rows), 10, "the restarted w1's typing row")
    assert resets == ["w1", "w1"]  # the restarted writer lost its rows: a reset
    assert [row["room"] for _, _, row in typing_rows] == ["room9"]


async def test_rows_returned_whole_are_sent_from_memory_and_equal_the_stored_rows(
    cluster: Cluster,
) -> None:
    """`insert(... RETURNING *)` rows go out without a read; other writes are read
    back; either way a row arrives exactly as catch-up would deliver it."""
    received: list[dict[str, Any]] = []
    if cluster.transport == "tcp":
        await started(cluster, "hub")
    w1 = await started(cluster, "w1")
    r_instance = cluster.instance("r")
    r_instance.on_rows("notes", lambda s, w, t, rows: received.extend(rows))
    r = await cluster.start(r_instance)
    await connected(w1, r)
    gen = w1.generator("notes")
    insert = (
        "INSERT INTO notes (stream_id, instance_name, body, amount) VALUES ({id}, 'w1', %s, 1.5)"
    )

    async def arrived(count: int) -> None:
        await pace.until(lambda: len(received) >= count, 10, f"{count} notes rows at r")

    await gen.insert(insert + " RETURNING *", ("whole",))
    await arrived(1)
    await gen.insert(insert + " RETURNING stream_id", ("id only",))
    await arrived(2)
    async with w1.db.transaction() as txn:
        await gen.insert_txn(txn, insert + " RETURNING *", ("in a transaction",))
    await arrived(3)

    async def rolled_back() -> None:
        async with w1.db.transaction() as txn:
            await gen.insert_txn(txn, insert + " RETURNING *", ("rolled back",))
            raise RuntimeError("roll back")

    with pytest.raises(RuntimeError):
        await rolled_back()
    async with gen.get_next() as stream_id, w1.db.transaction() as txn:
        await txn.execute(
            "INSERT INTO notes (stream_id, instance_name, body, amount) VALUES (%s, 'w1', %s, 1.5)",
            (stream_id, "get_next"),
        )
    await arrived(4)
    await asyncio.sleep(0.3)

    stored, _, _ = await r.generator("notes").get_updates_since("w1", 0, stream_id, 100)
    codec = DictRows()
    assert received == [codec.from_db(row) for row in stored]
    assert [row["body"] for row in received] == ["whole", "id only", "in a transaction", "get_next"]
    assert isinstance(received[0]["at"], str)  # JSON-safe, live or read back
    assert received[0]["amount"] == "1.5"
    # Only the writes that did not return whole rows (and the rollback) were read back.
    assert metric(w1, "plait_rows_read_back_total", stream="notes") == 2


async def test_tcp_clients_catch_up_after_the_hub_restarts(db: Database) -> None:
    """≥ 250 rows missed while the hub is down, read back in pages of 100."""
    async with cluster_of(db, "tcp", hub="hub", catch_up_page_max=100) as cluster:
        seen = Seen()
        hub = await started(cluster, "hub")
        w1 = await started(cluster, "w1")
        r = await started(cluster, "r", seen)
        await connected(hub, w1, r)
        first = await write(w1, "before")
        await seen.wait(1)
        await hub.stop()
        missed = await write_many(w1, 260, "missed")
        await started(cluster, "hub")
        await seen.wait(261)
        await asyncio.sleep(0.3)
        assert [row[1] for row in seen.rows] == [first, *missed]  # once each, in order
        assert metric(r, "plait_catch_up_pages_total", stream="events") >= 3


async def test_application_commands_positions_and_metrics(cluster: Cluster) -> None:
    got: dict[str, list[UserSync]] = {"w1": [], "r": []}
    moved: list[tuple[str, int]] = []
    if cluster.transport == "tcp":
        await started(cluster, "hub")
    instances = {}
    for name in ("w1", "r"):
        inst = cluster.instance(name)
        inst.register_command(UserSync, got[name].append)
        if name == "r":
            inst.on_position("events", lambda s, w, t: moved.append((w, t)))
        instances[name] = await cluster.start(inst)
    w1, r = instances["w1"], instances["r"]
    await connected(w1, r)

    w1.send_command(UserSync("w1", "@alice:example.org", "start", 1700))
    await pace.until(lambda: bool(got["r"]), 10, "w1's USER_SYNC at r")
    assert got["r"] == [UserSync("w1", "@alice:example.org", "start", 1700)]
    # Over Redis a process hears its own commands too; over TCP the hub relays to others.
    assert len(got["w1"]) == (1 if cluster.transport == "redis" else 0)

    sid = await write(w1, "moves")
    await pace.until(
        lambda: any(t >= sid for w, t in moved if w == "w1"),
        10,
        f"r's position of w1 to move to {sid}",
    )

    async with aiohttp.ClientSession() as http, http.get(f"{r.http_url}/metrics") as response:
        text = await response.text()
    assert 'plait_commands_received_total{command="USER_SYNC"} 1.0' in text
    assert 'plait_rdata_rows_total{stream="events"} 1.0' in text
    assert 'plait_stream_position{stream="events",writer="w1"}' in text
    assert "plait_connection_up" in text


async def test_a_malformed_line_on_tcp_gets_error_and_the_connection_lives_on(
    db: Database,
) -> None:
    async with cluster_of(db, "tcp", hub="w1") as cluster:
        w1 = await started(cluster, "w1")
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.hub_port)
        try:
            writer.write(b"NAME raw\n")
            assert (await reader.readline()).startswith(b"SERVER w1")
            writer.write(b"POSITION events raw not-a-number 3\nREPLICATE\n")
            lines: list[bytes] = []
            async with pace.within(5, "the hub's ERROR for the malformed line"):
                while not any(line.startswith(b"ERROR") for line in lines):
                    lines.append(await reader.readline())
                    assert lines[-1], "the hub closed the connection"
            error = next(line for line in lines if line.startswith(b"ERROR"))
            assert b"bad prev" in error
            sid = await write(w1, "after the bad line")
            async with pace.within(5, "w1's RDATA after the malformed line"):
                while not (line := await reader.readline()).startswith(b"RDATA events w1"):
                    assert line, "the hub closed the connection"
            assert line.split(b" ")[3] == str(sid).encode()
        finally:
            writer.close()
            await writer.wait_closed()


async def test_writers_keep_writing_through_a_redis_restart_every_reader_gets_every_row_once(
    redis_cluster: Cluster, redis_server: RedisServer
) -> None:
    """Writes never pause: before, while the server is down, and while everyone
    reconnects and catches up; live rows and caught-up rows must not overlap or gap."""
    seen = {name: Seen() for name in ("w1", "w2", "r")}
    instances = {name: await started(redis_cluster, name, seen[name]) for name in seen}
    await connected(*instances.values())
    written: dict[str, list[int]] = {"w1": [], "w2": []}
    stop = asyncio.Event()

    async def keep_writing(name: str) -> None:
        n = 0
        while not stop.is_set():
            written[name].append(await write(instances[name], f"{name}-{n}"))
            n += 1
            await asyncio.sleep(0.003)

    async def each_writes(more: int, when: str) -> None:
        """Until each writer wrote `more` rows from now (at its own pace: a busy machine
        only makes the phase longer)."""
        marks = {name: len(ids) for name, ids in written.items()}
        await pace.until(
            lambda: all(len(written[n]) >= marks[n] + more for n in written),
            60,
            f"each writer to write {more} rows {when}",
        )

    writers = [asyncio.create_task(keep_writing(name)) for name in written]
    try:
        await each_writes(20, "before Redis stops")
        redis_server.stop()
        await each_writes(20, "while Redis is down")
        redis_server.start()
        await each_writes(40, "after Redis started again")
    finally:
        stop.set()
        await asyncio.gather(*writers)

    expected = {
        "r": sorted(written["w1"] + written["w2"]),
        "w1": sorted(written["w2"]),  # every writer reads the other one
        "w2": sorted(written["w1"]),
    }
    for name, ids in expected.items():
        await seen[name].wait(len(ids), within=30)
    await asyncio.sleep(0.5)
    for name, ids in expected.items():
        got = [row[1] for row in seen[name].rows]
        assert sorted(got) == ids, name  # every row, exactly once
        for writer in ("w1", "w2"):  # in order per writer
            mine = [row[1] for row in seen[name].rows if row[2] == writer]
            assert mine == sorted(mine), (name, writer)
    # The rows written while the server was down came by catching up.
    assert metric(instances["r"], "plait_catch_up_rows_total", stream="events") > 0


async def test_any_writer_streams_replicate_between_instances(cluster: Cluster) -> None:
    """A stream anyone may write (no configured writers, no position rows): each
    instance gets every other instance's rows exactly once."""
    async with cluster.db.connection() as conn:
        await conn.execute(
            "CREATE TABLE anyone (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
            " payload TEXT); CREATE INDEX ON anyone (instance_name, stream_id);"
            " CREATE INDEX ON anyone (stream_id)"
        )
    stream = {"name": "anyone", "tables": [{"name": "anyone"}], "writers": []}
    received: dict[str, list[Any]] = {"w1": [], "w2": [], "r": []}

    def collect(name: str, stream: str, writer: str, token: int, rows: list[Any]) -> None:
        received[name].extend(rows)

    def arrived(name: str, count: int) -> bool:
        return len(received[name]) >= count

    instances = {}
    if cluster.transport == "tcp":
        instances["hub"] = await cluster.start(cluster.instance("hub", streams=[*STREAMS, stream]))
    for name in ("w1", "w2", "r"):
        inst = cluster.instance(name, streams=[*STREAMS, stream])
        inst.on_rows("anyone", functools.partial(collect, name))
        instances[name] = await cluster.start(inst)
    await connected(*instances.values())
    written: dict[str, list[int]] = {"w1": [], "w2": []}

    async def write_some(name: str) -> None:
        # Both at once: one writer's own writes keep completing while the other's rows
        # are on their way to it.
        gen = instances[name].generator("anyone")
        for i in range(40):
            written[name] += await gen.insert(
                "INSERT INTO anyone VALUES ({id}, %s, %s) RETURNING *", (name, f"{name}-{i}")
            )

    await asyncio.gather(write_some("w1"), write_some("w2"))
    expected = {
        "r": sorted(written["w1"] + written["w2"]),
        "w1": written["w2"],
        "w2": written["w1"],
    }
    for name, ids in expected.items():
        try:
            await pace.until(
                functools.partial(arrived, name, len(ids)),
                10,
                f"{len(ids)} rows at {name}",
            )
        except TimeoutError as late:
            got = {n: (len(received[n]), len(i)) for n, i in expected.items()}
            raise AssertionError(f"{late}; (received, expected) rows: {got}") from None
    await asyncio.sleep(0.3)
    for name, ids in expected.items():
        assert sorted(row["stream_id"] for row in received[name]) == sorted(ids), name


async def test_a_writer_that_starts_after_a_reader_loses_no_rows(cluster: Cluster) -> None:
    """The reader starts when only w1 has a position row (its generator seats w2 at
    persisted-up-to); w2 starts later, and both write at once: the reader must follow
    w2 from its first row."""
    seen = Seen()
    if cluster.transport == "tcp":
        await started(cluster, "hub")
    w1 = await started(cluster, "w1")
    r = await started(cluster, "r", seen)
    w2 = await started(cluster, "w2")
    await connected(w1, r, w2)
    written: dict[str, list[int]] = {"w1": [], "w2": []}

    async def write_some(instance: Instance) -> None:
        for i in range(40):
            written[instance.name].append(await write(instance, f"{instance.name}-{i}"))

    await asyncio.gather(write_some(w1), write_some(w2))
    expected = sorted(written["w1"] + written["w2"])
    with contextlib.suppress(TimeoutError):  # the assertion below says what is missing
        await seen.wait(len(expected), within=10)
    await asyncio.sleep(0.3)
    assert sorted(row[1] for row in seen.rows) == expected


async def test_a_backwards_stream_replicates_live_and_by_catching_up(
    redis_cluster: Cluster, redis_server: RedisServer
) -> None:
    """Negative IDs on the wire and in the callbacks, positive inside: live rows, a
    catch-up after a Redis restart, and waiting for a (negative) position."""
    async with redis_cluster.db.connection() as conn:
        await conn.execute(
            "CREATE TABLE backfill (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
            " payload TEXT); CREATE INDEX ON backfill (instance_name, stream_id)"
        )
    stream = {
        "name": "backfill",
        "tables": [{"name": "backfill"}],
        "writers": ["w1"],
        "backwards": True,
    }
    calls: list[tuple[int, list[int]]] = []
    w1 = await redis_cluster.start(redis_cluster.instance("w1", streams=[*STREAMS, stream]))
    r_instance = redis_cluster.instance("r", streams=[*STREAMS, stream])
    r_instance.on_rows(
        "backfill", lambda s, w, t, rows: calls.append((t, [row["stream_id"] for row in rows]))
    )
    r = await redis_cluster.start(r_instance)
    await connected(w1, r)
    gen = w1.generator("backfill")
    insert = "INSERT INTO backfill SELECT {id}, 'w1', 'x' FROM generate_series(1, %s) RETURNING *"

    live = await gen.insert(insert, (3,))
    assert live == sorted(live, reverse=True)
    assert live[0] < 0
    assert await r.wait_for_stream_position("w1", "backfill", live[-1], timeout=5)

    redis_server.stop()
    missed = await gen.insert(insert, (150,))
    redis_server.start()
    assert await r.wait_for_stream_position("w1", "backfill", missed[-1], timeout=15)
    got = [stream_id for _, ids in calls for stream_id in ids]
    assert got == live + missed  # every row once, in stream order (more negative later)
    assert all(token < 0 for token, _ in calls)
    assert r.generator("backfill").get_positions()["w1"] == missed[-1]


async def test_any_writer_streams_catch_up_after_a_redis_restart(
    redis_cluster: Cluster, redis_server: RedisServer
) -> None:
    async with redis_cluster.db.connection() as conn:
        await conn.execute(
            "CREATE TABLE anyone (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
            " payload TEXT); CREATE INDEX ON anyone (instance_name, stream_id)"
        )
    stream = {"name": "anyone", "tables": [{"name": "anyone"}], "writers": []}
    received: dict[str, list[int]] = {"w1": [], "w2": []}

    def collect(name: str, stream: str, writer: str, token: int, rows: list[Any]) -> None:
        received[name].extend(row["stream_id"] for row in rows)

    def arrived(name: str, count: int) -> bool:
        return len(received[name]) >= count

    instances = {}
    for name in ("w1", "w2"):
        inst = redis_cluster.instance(name, streams=[*STREAMS, stream])
        inst.on_rows("anyone", functools.partial(collect, name))
        instances[name] = await redis_cluster.start(inst)
    await connected(*instances.values())
    insert = "INSERT INTO anyone SELECT {id}, %s, 'x' FROM generate_series(1, %s) RETURNING *"
    before = {n: await instances[n].generator("anyone").insert(insert, (n, 5)) for n in received}
    await pace.until(
        lambda: all(len(ids) == 5 for ids in received.values()),
        10,
        "the other's 5 rows at w1 and at w2",
    )
    redis_server.stop()
    during = {n: await instances[n].generator("anyone").insert(insert, (n, 120)) for n in received}
    redis_server.start()
    after = {n: await instances[n].generator("anyone").insert(insert, (n, 5)) for n in received}
    other = {"w1": "w2", "w2": "w1"}
    for name in received:
        wanted = before[other[name]] + during[other[name]] + after[other[name]]
        await pace.until(
            functools.partial(arrived, name, len(wanted)),
            15,
            f"{len(wanted)} rows at {name}",
        )
        await asyncio.sleep(0.2)
        assert received[name] == wanted, name  # every row once, in order


async def test_in_memory_stream_of_two_writers_caught_up_in_pages(cluster: Cluster) -> None:
    """Each writer keeps its own rows; a late reader reads both over HTTP, 250 keys
    each in growing pages (the first page of each a reset), then follows them live."""
    stream = {"name": "presence", "kind": "memory", "writers": ["w1", "w2"]}
    if cluster.transport == "tcp":
        await cluster.start(cluster.instance("hub", streams=[*STREAMS, stream]))
    writers = {}
    for name in ("w1", "w2"):
        writers[name] = await cluster.start(cluster.instance(name, streams=[*STREAMS, stream]))
    for name, inst in writers.items():
        for i in range(250):
            inst.memory("presence").write(f"user{i}", {"user": f"user{i}", "by": name, "v": 0})
        inst.memory("presence").write("user0", {"user": "user0", "by": name, "v": 1})
    state: dict[tuple[str, str], dict[str, Any]] = {}
    resets: list[str] = []
    r_instance = cluster.instance("r", streams=[*STREAMS, stream])
    r_instance.on_rows(
        "presence",
        lambda s, w, t, rows: state.update({(w, row["user"]): row for row in rows}),
    )
    r_instance.on_reset("presence", lambda s, w: resets.append(w))
    r = await cluster.start(r_instance)
    await connected(r, *writers.values())
    assert sorted(resets) == ["w1", "w2"]  # once per writer, for its first page
    assert len(state) == 500
    assert state[("w1", "user0")]["v"] == 1
    assert state[("w2", "user0")]["v"] == 1
    assert metric(r, "plait_catch_up_pages_total", stream="presence") >= 4  # 100, then 200
    token = writers["w2"].memory("presence").write("user7", {"user": "user7", "by": "w2", "v": 2})
    assert await r.wait_for_stream_position("w2", "presence", token, timeout=5)
    assert state[("w2", "user7")]["v"] == 2


async def test_a_shared_secret_guards_the_internal_api_of_instances(cluster: Cluster) -> None:
    """Every instance of the deployment shares the secret (catch-up of in-memory
    streams uses the API too); requests without it get 401, metrics stay open."""

    def http(name: str) -> dict[str, Any]:
        return {"http": {"port": cluster.ports[name], "secret": "s3cret-token"}}

    if cluster.transport == "tcp":
        await cluster.start(cluster.instance("hub", **http("hub")))
    w1_instance = cluster.instance("w1", **http("w1"))
    w1_instance.register_endpoint("echo", _echo)
    w1 = await cluster.start(w1_instance)
    w1.memory("typing").write("room", {"users": ["a"]})
    r_instance = cluster.instance("r", **http("r"))
    typing: list[Any] = []
    r_instance.on_rows("typing", lambda s, w, t, rows: typing.extend(rows))
    r = await cluster.start(r_instance)
    await connected(w1, r)
    assert typing == [{"users": ["a"]}]  # caught up over HTTP, with the secret
    assert await r.call("w1", "echo", {"x": 1}) == {"x": 1}
    async with aiohttp.ClientSession() as client:
        base = w1.http_url
        async with client.get(
            f"{base}/_plait/v1/streams/typing/updates?from=0&to=9&limit=5"
        ) as rsp:
            assert rsp.status == 401
        headers = {"Authorization": "Bearer wrong"}
        async with client.post(f"{base}/_plait/v1/call/echo/t1", json={}, headers=headers) as rsp:
            assert rsp.status == 401
        async with client.get(f"{base}/metrics") as rsp:
            assert rsp.status == 200


async def _echo(args: Any) -> Any:
    return args


async def _forge(cluster: Cluster, channel: str, lines: list[str]) -> None:
    """Send `lines` as a rogue peer: one PUBLISH each on the deployment's Redis channel,
    or a raw TCP client of the hub that names itself `evil`."""
    if cluster.transport == "redis":
        publisher = aioredis.Redis.from_url(cluster.redis_url)
        try:
            for line in lines:
                await publisher.publish(channel, line)
        finally:
            await publisher.aclose()
        return
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.hub_port)
    try:
        writer.write(b"NAME evil\n")
        await writer.drain()
        await reader.readline()  # SERVER
        for line in lines:
            writer.write(line.encode() + b"\n")
        await writer.drain()
        await asyncio.sleep(0.5)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_a_forged_position_above_the_sequence_head_is_refused(cluster: Cluster) -> None:
    """Issue 18, finding 1: one line from any peer made a writer adopt 10^9 as its own
    position, store it and stop writing. A position (or row) above the sequence head
    is impossible: refused wherever it arrives, stored nowhere (R-ID-14)."""
    if cluster.transport == "tcp":
        await started(cluster, "hub")
    seen = Seen()
    w1 = await started(cluster, "w1")
    w2 = await started(cluster, "w2")
    r = await started(cluster, "r", seen)
    await connected(w1, w2, r)
    first = await write(w1, "before")
    await seen.wait(1)
    huge = 1_000_000_000
    await _forge(
        cluster,
        r.config.channel,
        [
            f"POSITION events w2 0 {huge}",
            f"FENCED events w2 {huge}",  # a fence nobody made
            f'RDATA events w1 {huge - 1} ["events",{huge - 1},"w1","forged"]',
        ],
    )
    await asyncio.sleep(3 * 0.2)  # announce and flush intervals: a stored claim shows
    for instance in (w1, w2, r):
        gen = instance.generator("events")
        assert max(gen.get_positions().values()) < huge, instance.name
        assert gen.get_persisted_upto_position() < huge, instance.name
    assert w1.generator("events").get_current_token_for_writer("w1") < huge
    assert max((await stored_positions(cluster.db)).values()) < huge
    assert metric(r, "plait_refused_positions_total", stream="events") >= 1
    # Writing goes on, and every row reaches the reader; the forged one never does.
    later = [await write(w1, "after"), await write(w2, "after")]
    await seen.wait(3)
    assert sorted(row[1] for row in seen.rows) == sorted([first, *later])
    assert all(row[3] != "forged" for row in seen.rows)
