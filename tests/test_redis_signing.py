"""Signed Redis lines end to end (R-RP-9, issue 18 finding 1): instances on a real
PostgreSQL and a real Redis, and a rogue client of that Redis that PUBLISHes on the
deployment's channel without the deployment's secret.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as aioredis

from plait import Database
from plait.instance import Instance
from replication_helpers import Cluster, Seen, cluster_of, connected, metric, until, write

pytestmark = pytest.mark.timeout(60)

SECRET = "the deployment's secret"
BILLION = 1_000_000_000


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
            await until(lambda: all(refused(i) >= 4 for i in (w1, w2, r)))
        finally:
            await rogue.aclose()


async def test_instances_with_different_secrets_exchange_nothing_and_say_why(
    db: Database, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="plait.replication.redis_transport")
    async with cluster_of(db, "redis", redis_url=redis_url) as cluster:
        seen = Seen()
        w1 = await cluster.start(signed(cluster, "w1", "one secret"))
        r = signed(cluster, "r", "another secret")
        r.on_rows("events", seen.on_rows)
        await cluster.start(r)
        # r's REPLICATE reaches w1 (which started first), and is dropped there.
        await until(lambda: refused(w1) >= 1)
        for body in ("a", "b", "c"):
            await write(w1, body)
        await until(lambda: refused(r) >= 3)  # 3 RDATA at least
        await asyncio.sleep(0.3)
        assert seen.rows == []
        warnings = [
            rec.getMessage()
            for rec in caplog.records
            if rec.name == "plait.replication.redis_transport" and "signature" in rec.getMessage()
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
        await until(lambda: r.generator("events").get_positions()["w1"] == ids[-1])
        assert refused(r) == 0
