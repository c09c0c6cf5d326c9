"""Signed Redis lines end to end (R-RP-9, issue 18 finding 1): instances on a real
PostgreSQL and a real Redis, and a rogue client of that Redis that PUBLISHes on the
deployment's channel without the deployment's secret.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

import pace
from pace import scaled
from plait import Database
from plait.instance import Instance
from plait.replication.metrics import ReplicationMetrics
from plait.replication.redis_transport import RedisTransport
from redis_helpers import RecordingHandler, channel, redis_transport
from redis_server import RedisServer
from replication_helpers import (
    Cluster,
    Seen,
    cluster_of,
    connected,
    create_tables,
    metric,
    write,
)

# Replication end to end again, every line signed (with this module's `cluster` and
# `redis_cluster` fixtures below).
from test_replication import (  # noqa: F401
    test_a_backwards_stream_replicates_live_and_by_catching_up,
    test_an_idle_writer_lets_the_linear_position_advance,
    test_any_writer_streams_catch_up_after_a_redis_restart,
    test_application_commands_positions_and_metrics,
    test_live_rows_reach_other_instances_in_order_with_batches_together,
    test_redis_restart_while_writers_write_every_row_arrives_exactly_once,
    test_wait_for_stream_position_and_read_your_writes,
    test_writers_keep_writing_through_a_redis_restart_every_reader_gets_every_row_once,
)
from transport_helpers import RecordingBackoff, eventually

LOGGER = "plait.replication.redis_transport"

pytestmark = pytest.mark.timeout(60)

SECRET = "the deployment's secret"
BILLION = 1_000_000_000


class SignedCluster(Cluster):
    """A Redis cluster whose instances all have the deployment's secret."""

    def config(self, name: str, **overrides: Any) -> dict[str, Any]:
        replication = {"secret": SECRET, **overrides.pop("replication", {})}
        return super().config(name, replication=replication, **overrides)


@pytest.fixture
async def cluster(db: Database, redis_url: str) -> AsyncIterator[Cluster]:
    await create_tables(db)
    signed = SignedCluster(db, "redis", redis_url=redis_url)
    try:
        yield signed
    finally:
        await signed.close()


@pytest.fixture
async def redis_cluster(db: Database, redis_server: RedisServer) -> AsyncIterator[Cluster]:
    await create_tables(db)
    signed = SignedCluster(db, "redis", redis_url=redis_server.url, catch_up_page_max=100)
    try:
        yield signed
    finally:
        await signed.close()


def signed(cluster: Cluster, name: str, secret: str = SECRET) -> Instance:
    return cluster.instance(name, replication={"secret": secret})


def refused(instance: Instance) -> float:
    return sum(
        metric(instance, "plait_refused_lines_total", link="redis", reason=reason)
        for reason in ("unsigned", "bad_signature", "foreign", "replayed", "stale", "malformed")
    )


async def test_a_rogue_publish_neither_moves_positions_nor_delivers_rows(
    db: Database, redis_url: str
) -> None:
    """The attack of finding 1: one PUBLISH of `POSITION <stream> w2 0 1e9` made w1 adopt
    1e9, and a forged `RDATA` of w1 reached `on_rows` while the real row never did."""
    async with cluster_of(db, "redis", redis_url=redis_url) as cluster:
        seen = Seen()
        w1 = await cluster.start(signed(cluster, "w1"))
        w2 = await cluster.start(signed(cluster, "w2"))
        r = signed(cluster, "r")
        r.on_rows("events", seen.on_rows)
        await cluster.start(r)
        await connected(w1, w2, r)
        first = await write(w1, "real")
        await seen.wait(1)
        rogue = aioredis.Redis.from_url(redis_url)
        try:
            channel = r.config.channel
            await rogue.publish(channel, f"POSITION events w2 0 {BILLION}")
            forged = f'RDATA events w1 {first + 1} ["events",{first + 1},"w1","forged"]'
            await rogue.publish(channel, forged)
            # Both lines in one message too, as the transport batches them.
            await rogue.publish(channel, f"POSITION events w2 0 {BILLION}\n{forged}")
            second = await write(w1, "next")
            await seen.wait(2)
            await asyncio.sleep(0.5)  # announcements of an idle w1 (announce_interval 0.2 s)
            assert [row[3] for row in seen.rows] == ["real.0", "next.0"], seen.rows
            assert second == first + 1  # the forged row claimed the real row's token
            for instance in (w1, w2, r):
                positions = instance.generator("events").get_positions()
                assert max(positions.values()) < BILLION, (instance.name, positions)
            assert w1.generator("events").get_current_token_for_writer("w1") == second
            await pace.until(
                lambda: all(refused(i) >= 4 for i in (w1, w2, r)),
                10,
                "4 refused lines (the rogue's) at each of w1, w2 and r",
            )
        finally:
            await rogue.aclose()


async def test_instances_with_different_secrets_exchange_nothing_and_say_why(
    db: Database, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with cluster_of(db, "redis", redis_url=redis_url) as cluster:
        seen = Seen()
        w1 = await cluster.start(signed(cluster, "w1", "one secret"))
        r = signed(cluster, "r", "another secret")
        r.on_rows("events", seen.on_rows)
        await cluster.start(r)
        # r's REPLICATE reaches w1 (which started first), and is dropped there.
        await pace.until(lambda: refused(w1) >= 1, 10, "w1 to refuse r's REPLICATE")
        for body in ("a", "b", "c"):
            await write(w1, body)
        await pace.until(lambda: refused(r) >= 3, 10, "r to refuse w1's 3 RDATA")
        await asyncio.sleep(0.3)
        assert seen.rows == []
        warnings = [
            rec.getMessage()
            for rec in caplog.records
            if rec.name == LOGGER and "signature" in rec.getMessage()
        ]
        # One warning per instance in the interval, however many lines were dropped.
        assert len(warnings) == 2, warnings
        assert all("replication.secret" in text for text in warnings), warnings


async def test_rows_and_positions_replicate_with_a_secret(db: Database, redis_url: str) -> None:
    async with cluster_of(db, "redis", redis_url=redis_url) as cluster:
        seen = Seen()
        w1 = await cluster.start(signed(cluster, "w1"))
        r = signed(cluster, "r")
        r.on_rows("events", seen.on_rows)
        await cluster.start(r)
        await connected(w1, r)
        ids = [await write(w1, f"row{i}", rows=2) for i in range(20)]
        await seen.wait(40)
        assert [row[1] for row in seen.rows] == [i for i in ids for _ in range(2)]
        await pace.until(
            lambda: r.generator("events").get_positions()["w1"] == ids[-1],
            10,
            f"r's position of w1 to reach {ids[-1]}",
        )
        assert refused(r) == 0


# -- the transport alone, with a recording handler ----------------------------------------


@pytest.fixture
async def make_transport() -> AsyncIterator[Callable[..., RedisTransport]]:
    """Builds transports and stops them all at the end, also when the test failed."""
    made: list[RedisTransport] = []

    def make(handler: RecordingHandler, url: str, name: str, **kwargs: Any) -> RedisTransport:
        transport = redis_transport(handler, url, name, **kwargs)
        made.append(transport)
        return transport

    yield make
    async with pace.within(10, "the test's transports to stop"):
        for transport in made:
            await transport.stop()


def refusals(metrics: ReplicationMetrics, reason: str) -> float:
    labels = {"link": "redis", "reason": reason}
    return metrics.registry.get_sample_value("plait_refused_lines_total", labels) or 0.0


async def started_pair(
    make: Callable[..., RedisTransport], url: str, secrets: tuple[str | None, str | None]
) -> tuple[RecordingHandler, RecordingHandler, ReplicationMetrics, ReplicationMetrics, str]:
    name = channel()
    a, b = RecordingHandler("a"), RecordingHandler("b")
    ma, mb = ReplicationMetrics(), ReplicationMetrics()
    for handler, metrics, secret in ((a, ma, secrets[0]), (b, mb, secrets[1])):
        transport = make(handler, url, name, secret=secret, metrics=metrics)
        await transport.start()
        assert await transport.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
    return a, b, ma, mb, name


async def test_a_signed_sender_speaks_only_for_itself_or_announces_a_fence(
    redis_url: str, make_transport: Callable[..., RedisTransport]
) -> None:
    a, b, _, mb, _ = await started_pair(make_transport, redis_url, (SECRET, SECRET))
    sent = {
        "RDATA s a 1 {}": True,
        "RDATA s b 2 {}": False,  # b's row, from a
        "POSITION s c 3 4": False,  # c's position, from a
        "POSITION s c 5 5": False,  # the old form of a fence: now FENCED only
        "FENCED s c 5": True,  # a fenced c at 5 and says so (checked by the handler)
        "POSITION s a 1 2": True,
        "DEPART c": False,
        "DEPART a": True,
        "RDATA s a 9 {}": True,
    }
    for line in sent:
        a.session.link.send(line)
    await eventually(lambda: "RDATA s a 9 {}" in b.session.lines, "a's last line at b")
    assert [line for line in b.session.lines if line in sent] == [
        line for line, allowed in sent.items() if allowed
    ]
    assert refusals(mb, "foreign") == 4
    assert a.session.authenticated  # signed: the handler takes a writer's own word
    assert b.session.authenticated


async def test_replayed_messages_reach_nobody_twice_and_a_replay_out_of_order_restarts(
    redis_url: str, make_transport: Callable[..., RedisTransport]
) -> None:
    a, b, _, mb, name = await started_pair(make_transport, redis_url, (SECRET, SECRET))

    def heard_at_b(line: str) -> bool:
        return line in b.session.lines

    rogue = aioredis.Redis.from_url(redis_url)
    pubsub = rogue.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.subscribe(name)
        await asyncio.sleep(0.1)
        for i in range(1, 4):
            line = f"RDATA s a {i} {{}}"
            a.session.link.send(line)
            await eventually(functools.partial(heard_at_b, line), "a line at b")
        captured: list[bytes] = []
        async with pace.within(3, "a's 3 RDATA messages at the rogue subscriber"):
            while len(captured) < 3:
                message = await pubsub.get_message(timeout=1)
                if message is not None and b"\nRDATA s a " in message["data"]:
                    captured.append(message["data"])
        for data in captured:  # the copies reach b (and a), unchanged
            await rogue.publish(name, data)
        await eventually(lambda: refusals(mb, "replayed") >= 3, "3 replays refused at b")
        assert rdata(b.session.lines) == [f"RDATA s a {i} {{}}" for i in range(1, 4)]

        # c subscribes later: a replay of a's first message is the first of a's run it
        # sees (accepted, as if c had subscribed earlier); a's next real message then
        # comes after a gap, so c starts over (and catches up, in the real handler).
        c, mc = RecordingHandler("c"), ReplicationMetrics()
        tc = make_transport(c, redis_url, name, secret=SECRET, metrics=mc)
        await tc.start()
        assert await tc.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
        await rogue.publish(name, captured[0])
        await eventually(lambda: "RDATA s a 1 {}" in c.session.lines, "the replay at c")
        a.session.link.send("RDATA s a 4 {}")
        await eventually(lambda: len(c.sessions) == 2, "c's new session after the gap")
        assert refusals(mc, "gap") >= 1
        assert "RDATA s a 4 {}" not in c.sessions[0].lines
        a.session.link.send("RDATA s a 5 {}")
        await eventually(lambda: "RDATA s a 5 {}" in c.session.lines, "a's next line at c")
    finally:
        await pubsub.aclose()
        await rogue.aclose()


async def test_a_replay_older_than_the_clock_skew_is_refused(
    redis_url: str, make_transport: Callable[..., RedisTransport]
) -> None:
    a, _, _, _, name = await started_pair(make_transport, redis_url, (SECRET, SECRET))
    rogue = aioredis.Redis.from_url(redis_url)
    pubsub = rogue.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.subscribe(name)
        await asyncio.sleep(0.1)
        a.session.link.send("DEPART a")
        async with pace.within(3, "a's DEPART message at the rogue subscriber"):
            while True:
                message = await pubsub.get_message(timeout=1)
                if message is not None and message["data"].endswith(b"\nDEPART a"):
                    break
        c, mc = RecordingHandler("c"), ReplicationMetrics()
        tc = make_transport(c, redis_url, name, secret=SECRET, metrics=mc, max_clock_skew=0.2)
        await tc.start()
        assert await tc.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
        await asyncio.sleep(0.3)  # the copy is now older than c's max_clock_skew
        await rogue.publish(name, message["data"])
        await eventually(lambda: refusals(mc, "stale") == 1, "the stale copy refused at c")
        assert "DEPART a" not in c.session.lines
    finally:
        await pubsub.aclose()
        await rogue.aclose()


async def test_a_signed_and_an_unsigned_instance_exchange_nothing(
    redis_url: str, make_transport: Callable[..., RedisTransport], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    a, b, ma, mb, _ = await started_pair(make_transport, redis_url, (SECRET, None))
    for i in range(1, 21):
        a.session.link.send(f"RDATA s a {i} {{}}")
        b.session.link.send(f"RDATA s b {i} {{}}")
    await eventually(lambda: refusals(mb, "signed_without_secret") >= 20, "a's lines at b")
    await eventually(lambda: refusals(ma, "unsigned") >= 20, "b's lines at a")
    assert not rdata([line for line in b.session.lines if " a " in line])
    assert not rdata([line for line in a.session.lines if " b " in line])
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert sum("signed message(s), but this instance has no" in m for m in messages) == 1
    assert sum("unsigned message(s)" in m for m in messages) == 1
    assert sum("are not signed (no replication.secret)" in m for m in messages) == 1  # b's
    assert a.session.authenticated
    assert not b.session.authenticated  # unsigned: the handler checks every claim


async def test_a_deployment_s_acl_user_and_password_carry_signed_lines(
    redis_server: RedisServer, make_transport: Callable[..., RedisTransport]
) -> None:
    """An ACL user that may only PING, SUBSCRIBE and PUBLISH on its deployment's channel
    is all plait needs (the README's example); another channel is refused to it."""
    name = channel()
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        # redis-py leaves execute_command unannotated.
        await admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", "plait-prod", "on", ">user-password", "resetchannels",
            f"&{name}", "-@all", "+ping", "+subscribe", "+publish",
        )  # fmt: skip
    finally:
        await admin.aclose()
    url = f"redis://plait-prod@127.0.0.1:{redis_server.port}/0"
    a, b = RecordingHandler("a"), RecordingHandler("b")
    for handler in (a, b):
        transport = make_transport(handler, url, name, password="user-password", secret=SECRET)
        await transport.start()
        assert await transport.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"
    a.session.link.send("RDATA s a 1 {}")
    await eventually(lambda: "RDATA s a 1 {}" in b.session.lines, "a's line at b")
    other = RecordingHandler("c")
    backoff = RecordingBackoff(initial=0.05, cap=0.1)
    wrong = make_transport(
        other, url, channel(), password="user-password", secret=SECRET, backoff=backoff
    )
    await wrong.start()
    await eventually(lambda: len(backoff.delays) >= 2, "the other channel refused")
    assert not other.sessions


def rdata(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("RDATA")]
