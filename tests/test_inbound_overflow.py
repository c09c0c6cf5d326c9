"""A reader slower than its writers (R-RP-9): its inbound queue stays within
`replication.inbound_queue`; past it the stream catches up from the database instead,
and the reader still gets every row exactly once, in order. Real PostgreSQL, real
Redis or TCP."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import pace
from plait.instance import Instance
from replication_helpers import (
    Cluster,
    Seen,
    connected,
    metric,
    write,
    write_many,
)

pytestmark = pytest.mark.timeout(120)

BOUND = 50


class SlowReader(Seen):
    """`on_rows` that blocks until released, then takes 5 ms a call; it notes the
    inbound queue length of its instance at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.instance: Instance | None = None
        self.queue_lengths: list[float] = []

    def note_queue(self) -> None:
        assert self.instance is not None
        self.queue_lengths.append(
            metric(self.instance, "plait_inbound_queue_length", stream="events")
        )

    async def on_rows_slowly(self, stream: str, writer: str, token: int, rows: list[Any]) -> None:
        self.note_queue()
        await self.release.wait()
        await asyncio.sleep(0.005)
        self.on_rows(stream, writer, token, rows)


async def test_a_slow_reader_stays_within_its_bound_and_gets_every_row_once_in_order(
    cluster: Cluster,
) -> None:
    others = [await cluster.start(cluster.instance("hub"))] if cluster.transport == "tcp" else []
    w1 = await cluster.start(cluster.instance("w1"))
    w2 = await cluster.start(cluster.instance("w2"))
    reader = SlowReader()
    r = cluster.instance("r", replication={"inbound_queue": BOUND})
    r.on_rows("events", reader.on_rows_slowly)
    reader.instance = r
    await cluster.start(r)
    await connected(*others, w1, w2, r)

    # The reader's first on_rows blocks: everything after it waits in its queue.
    expected: dict[str, list[int]] = {"w1": [], "w2": []}
    expected["w1"].append(await write(w1, "first"))
    for i in range(10):  # IDs of three rows each: RDATA batches
        expected["w1"].append(await write(w1, f"batch{i}", rows=3))
    expected["w1"] += await write_many(w1, 1500, "w1-")
    expected["w2"] += await write_many(w2, 500, "w2-")
    expected["w1"].append(await write(w1, "last", rows=2))
    sent = 1 + 10 * 3 + 1500 + 500 + 2

    def received() -> float:
        return metric(r, "plait_commands_received_total", command="RDATA")

    await pace.until(lambda: received() >= sent, 30, f"r to receive all {sent} RDATA")
    reader.note_queue()
    reader.release.set()

    rows_per_id = {sid: 1 for ids in expected.values() for sid in ids}
    rows_per_id.update(dict.fromkeys(expected["w1"][1:11], 3))
    rows_per_id[expected["w1"][-1]] = 2
    await reader.wait(sum(rows_per_id.values()), within=60)
    await asyncio.sleep(0.5)  # nothing arrives twice later

    assert max(reader.queue_lengths) <= BOUND
    assert metric(r, "plait_inbound_overflows_total", stream="events") >= 1
    rows = reader.rows
    assert len(rows) == len(set(rows)) == sum(rows_per_id.values())  # exactly once
    for writer, ids in expected.items():
        got = [row[1] for row in rows if row[2] == writer]
        assert got == sorted(got)  # in order
        assert set(got) == set(ids)
    for sid, count in rows_per_id.items():  # every row of every ID
        assert len([row for row in rows if row[1] == sid]) == count


async def test_an_in_memory_stream_past_its_bound_catches_up_from_its_writer(
    cluster: Cluster,
) -> None:
    """Its rows live only in the writer: past the bound the reader reads the latest row
    of each key over HTTP, in token order, and never gets a token twice."""
    others = [await cluster.start(cluster.instance("hub"))] if cluster.transport == "tcp" else []
    w1 = await cluster.start(cluster.instance("w1"))
    got: list[tuple[int, Any]] = []
    release = asyncio.Event()

    async def on_rows(stream: str, writer: str, token: int, rows: list[Any]) -> None:
        await release.wait()
        got.extend((token, row) for row in rows)

    r = cluster.instance("r", replication={"inbound_queue": BOUND})
    r.on_rows("typing", on_rows)
    await cluster.start(r)
    await connected(*others, w1, r)

    typing = w1.memory("typing")
    latest: dict[str, int] = {}
    for i in range(20 * BOUND):
        room = f"room{i % 7}"
        token = typing.write(room, {"room": room, "n": i})
        latest[room] = i
        # Let the sender send each row: writes made with no await between them are sent
        # in one pass, as the latest row of each key only.
        await asyncio.sleep(0)
    await pace.until(
        lambda: metric(r, "plait_commands_received_total", command="RDATA") >= 20 * BOUND,
        10,
        f"r to receive {20 * BOUND} RDATA",
    )
    assert metric(r, "plait_inbound_queue_length", stream="typing") <= BOUND
    release.set()
    assert await r.wait_for_stream_position("w1", "typing", token, timeout=30)

    assert metric(r, "plait_inbound_overflows_total", stream="typing") >= 1
    tokens = [t for t, _ in got]
    assert tokens == sorted(set(tokens))  # in order, never twice
    last_seen = {row["room"]: row["n"] for _, row in got}
    assert last_seen == latest
