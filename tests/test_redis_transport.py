"""The Redis pub/sub transport against a real Redis: ordering, echoes, pings, reconnects
with growing delays (also when failing before the handler caught up), and stop().

The handler here is a recording test double: the transport is under test, the handler
is its collaborator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

import pace
from pace import scaled
from plait.core.commands import MAX_LINE_BYTES
from plait.ports import free_port
from plait.replication.metrics import ReplicationMetrics
from plait.replication.redis_transport import RedisTransport
from redis_helpers import RecordingHandler, channel, redis_transport
from redis_server import RedisServer
from transport_helpers import RecordingBackoff, eventually

LOGGER = "plait.replication.redis_transport"


def gauge_up(metrics: ReplicationMetrics) -> float | None:
    return metrics.registry.get_sample_value("plait_connection_up", {"link": "redis"})


def reconnects(metrics: ReplicationMetrics) -> float:
    value = metrics.registry.get_sample_value("plait_reconnects_total", {"link": "redis"})
    return value or 0.0


def rdata(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("RDATA")]


@pytest.fixture
async def make_transport() -> AsyncIterator[Callable[..., RedisTransport]]:
    """Builds transports and stops them all at the end, also when the test failed."""
    made: list[RedisTransport] = []

    def make(handler: RecordingHandler, url: str, channel: str, **kwargs: Any) -> RedisTransport:
        transport = redis_transport(handler, url, channel, **kwargs)
        made.append(transport)
        return transport

    yield make
    async with pace.within(10, "the test's transports to stop"):
        for transport in made:
            await transport.stop()


@pytest.fixture
async def admin(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A plain client of the test's own server, to kill or pause the transport's."""
    client = Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


async def assert_no_tasks_left(before: set[asyncio.Task[Any]]) -> None:
    await asyncio.sleep(0)
    left = asyncio.all_tasks() - before
    assert not left, f"tasks left running: {left}"


async def test_lines_arrive_in_order_at_peers_and_as_echoes(
    redis_url: str, make_transport: Callable[..., RedisTransport]
) -> None:
    name = channel()
    a, b = RecordingHandler("a"), RecordingHandler("b")
    ta = make_transport(a, redis_url, name)
    tb = make_transport(b, redis_url, name)
    assert ta.label == "redis"
    await ta.start()
    await tb.start()
    assert await ta.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
    assert await tb.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"

    # Each one's own open() lines come back to it: SUBSCRIBE was confirmed before open().
    await eventually(lambda: a.open_line(0) in a.session.lines, "a's own open line")
    await eventually(lambda: b.open_line(0) in b.session.lines, "b's own open line")
    assert b.session.lines.index("REPLICATE") < b.session.lines.index(b.open_line(0))

    sent = [f'RDATA s a {i} {{"n":{i},"text":"é"}}' for i in range(1, 501)]
    for line in sent:
        a.session.link.send(line)  # never blocks, queued for the publisher
    await eventually(lambda: len(rdata(b.session.lines)) >= 500, "500 lines at b")
    assert rdata(b.session.lines) == sent
    # a gets its own lines back: dropping echoes is the handler's business.
    await eventually(lambda: len(rdata(a.session.lines)) >= 500, "500 echoes at a")
    assert rdata(a.session.lines) == sent
    assert all(isinstance(x, bytes) for x in b.session.raw)  # bytes, as received
    assert len(a.sessions) == len(b.sessions) == 1


async def test_a_burst_travels_in_few_messages_and_arrives_as_its_lines(
    redis_url: str, make_transport: Callable[..., RedisTransport]
) -> None:
    """Lines queued together share Redis messages (up to 64 KiB each); receivers split
    them back into the same lines, in order. A line with a break in it never travels."""
    name = channel()
    a, b = RecordingHandler("a"), RecordingHandler("b")
    ta, tb = make_transport(a, redis_url, name), make_transport(b, redis_url, name)
    await ta.start()
    await tb.start()
    assert await ta.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
    assert await tb.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
    watcher = Redis.from_url(redis_url)
    pubsub = watcher.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(name)
    await asyncio.sleep(0.1)
    sent = [f'RDATA s a {i} {{"n":{i},"pad":"{"x" * 200}"}}' for i in range(1, 1001)]
    a.session.link.send('RDATA s a 0 {"broken":"line\nbreak"}')
    for line in sent:
        a.session.link.send(line)
    await eventually(lambda: len(rdata(b.session.lines)) >= 1000, "1000 lines at b")
    assert rdata(b.session.lines) == sent
    messages: list[bytes] = []
    async with pace.within(5, "the 1000 lines' messages at the watcher"):
        while sum(m.count(b"\n") + 1 for m in messages) < 1000:
            message = await pubsub.get_message(timeout=1)
            if message is not None and message["data"].startswith(b"RDATA"):
                messages.append(message["data"])
    assert 4 <= len(messages) <= 10  # ~230 KB of lines in messages of at most 64 KiB
    assert all(len(m) <= 64 * 1024 for m in messages)
    await pubsub.aclose()
    await watcher.aclose()


async def test_pings_go_out_every_interval_and_never_reach_the_session(
    redis_url: str, make_transport: Callable[..., RedisTransport]
) -> None:
    name = channel()
    handler = RecordingHandler("a")
    async with Redis.from_url(redis_url) as observer, observer.pubsub() as pubsub:
        await pubsub.subscribe(name)
        assert (await pubsub.get_message(timeout=2))["type"] == "subscribe"
        # 0.1 s on a quiet machine: a busy one holds the loop longer than 3 intervals.
        interval = scaled(0.1)
        transport = make_transport(handler, redis_url, name, ping_interval=interval)
        await transport.start()
        assert await transport.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"

        seen: list[bytes] = []
        deadline = time.monotonic() + 10 * interval
        while (left := deadline - time.monotonic()) > 0:
            message = await pubsub.get_message(timeout=left)
            if message is not None and message["type"] == "message":
                seen.append(message["data"])
        pings = [data for data in seen if data.startswith(b"PING ")]
        assert 5 <= len(pings) <= 12, pings  # about one per interval
        assert all(data[5:].isdigit() for data in pings)

        # Someone else's PING is not the session's business either; other lines are.
        await observer.publish(name, b"PING 12345")
        await observer.publish(name, b"RDATA s b 1 {}")
        await eventually(lambda: "RDATA s b 1 {}" in handler.session.lines, "the RDATA line")
    assert not [line for line in handler.session.lines if line.startswith("PING")]
    # 10 intervals are over 3: the echoes of its own pings kept the connection alive.
    assert len(handler.sessions) == 1
    assert handler.session.closed_calls == 0


async def test_a_silent_path_ends_the_connection_and_it_comes_back(
    redis_server: RedisServer, admin: Redis, make_transport: Callable[..., RedisTransport]
) -> None:
    handler = RecordingHandler("a")
    transport = make_transport(
        handler, redis_server.url, channel(), ping_interval=0.1, backoff=RecordingBackoff()
    )
    await transport.start()
    assert await transport.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
    # PUBLISH waits while the server is paused: no PING comes back. Paused far longer
    # than the 3 ping intervals the transport waits, so that a busy machine still sees
    # the silence (with 0.7 s, the full suite's load once let the pause end first).
    await admin.client_pause(5000, all=False)  # WRITE only
    await eventually(
        lambda: handler.sessions[0].closed_calls == 1, "the connection to close", within=5.0
    )
    await eventually(
        lambda: len(handler.sessions) >= 2 and bool(handler.session.lines),
        "a new session",
        within=10.0,
    )
    assert handler.session.closed_calls == 0


async def test_a_publisher_whose_lines_go_nowhere_ends_the_connection_while_others_talk(
    redis_url: str, make_transport: Callable[..., RedisTransport]
) -> None:
    """Hearing other instances proves only the subscription: a connection whose own
    PINGs stop coming back is dead, or no peer would ever hear this instance again."""
    name = channel()
    handler = RecordingHandler("a")
    transport = make_transport(
        handler, redis_url, name, ping_interval=0.1, backoff=RecordingBackoff()
    )
    await transport.start()
    assert await transport.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
    queue = transport._queue
    assert queue is not None
    lost: list[str] = []

    def send(line: str) -> None:  # the publisher's half breaks
        lost.append(line)

    queue.send = send  # type: ignore[method-assign]
    async with Redis.from_url(redis_url) as other:
        talking = time.monotonic()
        while handler.sessions[0].closed_calls == 0 and time.monotonic() - talking < 3:
            await other.publish(name, b"RDATA s b 1 {}")  # another instance, still heard
            await asyncio.sleep(0.02)
    assert handler.sessions[0].closed_calls == 1
    assert time.monotonic() - talking < 0.8  # about 3 ping intervals
    assert any(line.startswith("PING ") for line in lost)
    assert "RDATA s b 1 {}" in handler.sessions[0].lines
    await eventually(lambda: len(handler.sessions) >= 2, "a new connection")


async def test_the_transports_clients_do_not_swallow_a_cancelled_publish(redis_url: str) -> None:
    """With a socket_timeout, redis-py sent every command through asyncio.wait_for,
    which on Python 3.11 swallows a cancellation arriving as the send completes (324 of
    400 cancelled PUBLISHes): a connection's publisher then outlived its connection."""
    transport = redis_transport(RecordingHandler("a"), redis_url, channel())
    client = transport._client()
    outcomes: list[str] = []
    try:
        for delay in [i * 0.0002 for i in range(100)]:

            async def publish() -> str:
                while True:
                    await client.publish("plait-test-cancel", b"x")
                    if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                        return "swallowed"

            task = asyncio.create_task(publish())
            await asyncio.sleep(delay)
            task.cancel()
            try:
                outcomes.append(await task)
            except asyncio.CancelledError:
                outcomes.append("cancelled")
    finally:
        await client.aclose()
    assert outcomes.count("swallowed") == 0, outcomes.count("swallowed")


async def test_a_task_that_swallows_its_cancellation_does_not_hold_the_connection(
    redis_server: RedisServer,
    admin: Redis,
    make_transport: Callable[..., RedisTransport],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection's receiver fails while its publisher is in a PUBLISH that ignores
    cancellation: the connection still ends and a new one opens (a TaskGroup waited for
    the publisher forever, which then went on publishing while nothing was received)."""
    publish = Redis.publish

    async def stubborn_publish(self: Redis, name: Any, message: Any, **options: Any) -> Any:
        with contextlib.suppress(asyncio.CancelledError):  # as redis-py did
            await asyncio.sleep(0.3)  # long enough to be in flight when the receiver fails
        return await publish(self, name, message, **options)

    monkeypatch.setattr(Redis, "publish", stubborn_publish)
    handler = RecordingHandler("a")
    transport = make_transport(
        handler, redis_server.url, channel(), ping_interval=5.0, backoff=RecordingBackoff()
    )
    await transport.start()
    assert await transport.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
    first = handler.session
    first.link.send("RDATA s a 1 {}")
    await asyncio.sleep(0.05)  # the publisher is in stubborn_publish
    await admin.client_kill_filter(_type="pubsub")
    await eventually(lambda: first.closed_calls == 1, "the connection to close")
    await eventually(lambda: len(handler.sessions) >= 2, "a new connection")
    handler.session.link.send("RDATA s a 2 {}")
    await eventually(lambda: "RDATA s a 2 {}" in handler.session.lines, "the new connection's echo")


async def test_a_restarted_server_is_reconnected_with_growing_delays(
    redis_server: RedisServer, make_transport: Callable[..., RedisTransport]
) -> None:
    handler = RecordingHandler("a")
    backoff = RecordingBackoff(initial=0.05, cap=0.4)
    metrics = ReplicationMetrics()
    transport = make_transport(
        handler, redis_server.url, channel(), backoff=backoff, metrics=metrics, ping_interval=1.0
    )
    await transport.start()
    assert await transport.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
    first = handler.session
    await eventually(lambda: gauge_up(metrics) == 1, "connection_up 1")
    assert backoff.ups == 1

    await asyncio.to_thread(redis_server.stop)
    await eventually(lambda: first.closed_calls == 1, "session.closed()")
    assert gauge_up(metrics) == 0
    assert not await transport.wait_open(0.01)
    first.link.send("RDATA s a 1 old")  # for the dead connection: dropped, not carried over
    await eventually(lambda: len(backoff.delays) >= 4, "4 failed attempts")
    assert backoff.delays[:4] == [0.05, 0.1, 0.2, 0.4]
    assert reconnects(metrics) >= 3
    assert len(handler.sessions) == 1

    await asyncio.to_thread(redis_server.start)
    await eventually(lambda: len(handler.sessions) == 2, "a new session")
    second = handler.session
    await eventually(lambda: gauge_up(metrics) == 1, "connection_up 1 again")
    assert backoff.ups == 2
    second.link.send("RDATA s a 2 new")
    await eventually(lambda: "RDATA s a 2 new" in second.lines, "lines to flow again")
    assert "RDATA s a 1 old" not in second.lines
    assert first.closed_calls == 1
    assert second.closed_calls == 0
    failed = len(backoff.delays)
    assert reconnects(metrics) == failed  # one count per attempt after a failure


async def test_failures_before_catch_up_keep_backing_off(
    redis_server: RedisServer, admin: Redis, make_transport: Callable[..., RedisTransport]
) -> None:
    handler = RecordingHandler("a", up=False)  # wait_up() blocks: catching up
    backoff = RecordingBackoff(initial=0.05, cap=0.8)
    metrics = ReplicationMetrics()
    transport = make_transport(
        handler, redis_server.url, channel(), backoff=backoff, metrics=metrics, ping_interval=1.0
    )
    await transport.start()
    for opened in range(1, 5):
        await eventually(lambda: len(handler.sessions) == opened, f"session {opened}")  # noqa: B023
        await admin.client_kill_filter(_type="pubsub")
        await eventually(lambda: handler.session.closed_calls == 1, "session.closed()")
    await eventually(lambda: len(handler.sessions) == 5, "session 5")

    assert backoff.delays == [0.05, 0.1, 0.2, 0.4]  # growing: never a tight loop
    assert backoff.ups == 0
    for i, delay in enumerate(backoff.delays):
        closed_at = handler.sessions[i].closed_at
        assert closed_at is not None
        assert handler.sessions[i + 1].opened_at - closed_at >= delay * 0.9
    assert gauge_up(metrics) == 0

    handler.may_be_up.set()  # caught up: now the backoff starts over
    await eventually(lambda: backoff.ups == 1, "backoff.up()")
    await eventually(lambda: gauge_up(metrics) == 1, "connection_up 1")
    await admin.client_kill_filter(_type="pubsub")
    await eventually(lambda: len(handler.sessions) == 6, "session 5")
    assert backoff.delays[4:] == [0.05]


async def test_bad_lines_cost_a_log_line_never_the_connection(
    redis_url: str, make_transport: Callable[..., RedisTransport], caplog: pytest.LogCaptureFixture
) -> None:
    handler = RecordingHandler("a")
    transport = make_transport(handler, redis_url, channel())
    await transport.start()
    assert await transport.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
    link = handler.session.link
    link.send("BOOM")  # the session raises on it
    link.send("RDATA s a 1 \ud800")  # not encodable as UTF-8
    link.send("RDATA s a 2 " + "x" * MAX_LINE_BYTES)  # over the line limit
    link.send("RDATA s a 3 {}")
    await eventually(lambda: "RDATA s a 3 {}" in handler.session.lines, "the good line")
    assert rdata(handler.session.lines) == ["RDATA s a 3 {}"]
    assert "BOOM" in handler.session.lines
    assert len(handler.sessions) == 1
    assert handler.session.closed_calls == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 3, errors


@pytest.mark.parametrize(
    "failure", ["wrong password", "nothing listening", "silent server", "echoing peer"]
)
async def test_failing_to_connect_retries_with_growing_delays_and_stops_promptly(
    failure: str,
    redis_server: RedisServer,
    make_transport: Callable[..., RedisTransport],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    silent_peers: list[asyncio.StreamWriter] = []
    server: asyncio.Server | None = None
    if failure == "wrong password":
        # (no such user: the server's nopass default user would take any password)
        url = f"redis://nobody:wrongpass@127.0.0.1:{redis_server.port}/0"
    elif failure == "nothing listening":
        url = f"redis://127.0.0.1:{free_port()}/0"
    elif failure == "silent server":  # accepts, never answers: only connect_timeout ends it

        def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            silent_peers.append(writer)

        server = await asyncio.start_server(accept, "127.0.0.1", 0)
        url = f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"
    if failure == "echoing peer":
        # What a client gets when it connects to its own port while the server is down
        # (a TCP self-connection): every command comes back as its answer.

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            silent_peers.append(writer)
            while data := await reader.read(65536):
                writer.write(data)

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        url = f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"
    try:
        before = asyncio.all_tasks()
        handler = RecordingHandler("a")
        backoff = RecordingBackoff(initial=0.05, cap=0.2)
        metrics = ReplicationMetrics()
        transport = make_transport(
            handler, url, channel(), backoff=backoff, metrics=metrics, connect_timeout=0.1
        )
        await transport.start()
        await eventually(lambda: len(backoff.delays) >= 4, "4 failed attempts")
        assert backoff.delays[:4] == [0.05, 0.1, 0.2, 0.2]
        assert not handler.sessions
        assert not await transport.wait_open(0.01)
        assert reconnects(metrics) >= 3

        started = time.monotonic()
        await transport.stop()
        assert time.monotonic() - started < 0.5
        await assert_no_tasks_left(before)
    finally:
        for writer in silent_peers:
            writer.close()
        if server is not None:
            server.close()
            await server.wait_closed()

    # One warning for the streak, the repeats at debug level; never the password. (At
    # info level: that lines travel unsigned, without a secret.)
    records = [r for r in caplog.records if r.name == LOGGER and r.levelno != logging.INFO]
    assert [r.levelno for r in records].count(logging.WARNING) == 1
    assert sum(r.levelno == logging.DEBUG for r in records) >= 3
    assert not any("wrongpass" in r.getMessage() for r in records)
    if failure == "wrong password":
        assert "nobody:***@127.0.0.1" in records[0].getMessage()
    if failure == "echoing peer":
        # redis-py 5-7 takes the echoed PING for a wrong answer; redis-py 8 trips over
        # the echoed HELLO first. Either way: one warning that this is no Redis server.
        assert "not a Redis server" in records[0].getMessage()


async def test_stop_while_connected_flushes_and_ends_every_task(
    redis_url: str, make_transport: Callable[..., RedisTransport]
) -> None:
    name = channel()
    observer = RecordingHandler("observer")
    watching = make_transport(observer, redis_url, name)
    await watching.start()
    assert await watching.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"

    before = asyncio.all_tasks()
    handler = RecordingHandler("a")
    metrics = ReplicationMetrics()
    transport = make_transport(handler, redis_url, name, metrics=metrics)
    await transport.start()
    assert await transport.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
    await eventually(lambda: gauge_up(metrics) == 1, "connection_up 1")
    sent = [f"RDATA s a {i} {{}}" for i in range(1, 201)]
    for line in sent:
        handler.session.link.send(line)
    started = time.monotonic()
    await transport.stop()  # at once: the queued lines still go out first
    assert time.monotonic() - started < 1.5
    await assert_no_tasks_left(before)
    assert handler.session.closed_calls == 1
    assert gauge_up(metrics) == 0
    assert not await transport.wait_open(0.01)
    await eventually(lambda: len(rdata(observer.session.lines)) >= 200, "the flushed lines")
    assert rdata(observer.session.lines) == sent
    handler.session.link.send("RDATA s a 999 {}")  # after stop: dropped, never raises
    await transport.stop()  # again: nothing to do


async def test_stop_while_disconnected_ends_every_task(
    redis_server: RedisServer, make_transport: Callable[..., RedisTransport]
) -> None:
    before = asyncio.all_tasks()
    handler = RecordingHandler("a")
    backoff = RecordingBackoff(initial=5.0, cap=5.0)  # stop() must not wait for it
    transport = make_transport(handler, redis_server.url, channel(), backoff=backoff)
    await transport.start()
    assert await transport.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
    await asyncio.to_thread(redis_server.stop)
    await eventually(lambda: handler.session.closed_calls == 1, "session.closed()")
    await eventually(lambda: len(backoff.delays) == 1, "a backoff delay")
    started = time.monotonic()
    await transport.stop()
    assert time.monotonic() - started < 0.5
    await assert_no_tasks_left(before)
    with pytest.raises(RuntimeError, match="once"):
        await transport.start()


async def test_stop_while_connecting_ends_every_task(redis_url: str) -> None:
    """stop() at any moment of connecting and subscribing (redis-py may swallow a
    cancellation that arrives then) still ends the transport promptly."""
    before = asyncio.all_tasks()
    for i in range(30):
        transport = redis_transport(RecordingHandler("a"), redis_url, channel())
        await transport.start()
        await asyncio.sleep(i * 0.0005)  # from before the first byte to subscribed
        async with pace.within(2, "stop() while connecting to end the transport"):
            await transport.stop()
    await assert_no_tasks_left(before)


async def test_stop_before_start_and_bad_settings() -> None:
    handler = RecordingHandler("a")
    transport = redis_transport(handler, "redis://127.0.0.1:1/0", "c")
    await transport.stop()
    assert not await transport.wait_open(0)
    with pytest.raises(ValueError, match="redis://"):
        redis_transport(handler, "http://:secret@example.com/", "c")
    with pytest.raises(ValueError, match="ping_interval"):
        redis_transport(handler, "redis://localhost/0", "c", ping_interval=0)
