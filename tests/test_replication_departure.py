"""A writer that shuts down cleanly (DEPART, R-RP-8) while its rows still wait behind a
slow reader: the reader delivers every one of them exactly once, in order, ends at the
writer's last position, and hears of the departure only after them. With the queue
within its bound and past it (R-RP-9: the departure survives the catch-up). Real
PostgreSQL, real Redis or TCP."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import pace
from plait import Database
from plait.instance import Instance
from plait.replication import retries
from plait.storage.stream_tables import StreamRow
from replication_helpers import (
    Cluster,
    Seen,
    TableRows,
    cluster_of,
    connected,
    metric,
    write,
    write_many,
)

# Above the sum of its own waits, which say what they waited for.
pytestmark = pytest.mark.timeout(240)

BURST = 600


class SlowRows(Seen):
    """`on_rows` that blocks until released; notes, at each call, whether the writer's
    departure was already heard of."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.departed: list[str] = []
        self.rows_after_departure = 0

    async def on_rows_slowly(self, stream: str, writer: str, token: int, rows: list[Any]) -> None:
        await self.release.wait()
        if writer in self.departed:
            self.rows_after_departure += len(rows)
        self.on_rows(stream, writer, token, rows)


@pytest.mark.parametrize("inbound_queue", [100_000, 50], ids=["within-bound", "past-bound"])
async def test_a_departing_writers_queued_rows_are_all_delivered_once(
    cluster: Cluster, inbound_queue: int
) -> None:
    others = [await cluster.start(cluster.instance("hub"))] if cluster.transport == "tcp" else []
    w1 = await cluster.start(cluster.instance("w1"))
    reader = SlowRows()
    r = cluster.instance("r", replication={"inbound_queue": inbound_queue})
    r.on_rows("events", reader.on_rows_slowly)
    r.on_departure(reader.departed.append)
    await cluster.start(r)
    await connected(*others, w1, r)

    # The reader's first on_rows blocks: everything after it waits in its queue.
    ids = [await write(w1, "first")]
    for i in range(5):  # IDs of three rows each: RDATA batches
        ids.append(await write(w1, f"batch{i}", rows=3))
    ids += await write_many(w1, BURST, "w1-")
    ids.append(await write(w1, "last", rows=2))
    rows_per_id = dict.fromkeys(ids, 1)
    rows_per_id.update(dict.fromkeys(ids[1:6], 3))
    rows_per_id[ids[-1]] = 2
    gen = w1.generator("events")
    await w1.stop()  # sends what is left, then DEPART
    last = gen.get_current_token_for_writer("w1")
    assert last >= ids[-1]

    def received(command: str) -> float:
        return metric(r, "plait_commands_received_total", command=command)

    try:
        await pace.until(lambda: received("DEPART") >= 1, 30, "the DEPART of w1")
        assert received("RDATA") >= sum(rows_per_id.values())  # sent before the DEPART
    finally:
        reader.release.set()  # or the reader's stop waits for its on_rows for ever

    await reader.wait(sum(rows_per_id.values()), within=60)
    assert await r.wait_for_stream_position("w1", "events", last, timeout=30), "w1's last position"
    await pace.until(lambda: reader.departed == ["w1"], 30, "the departure listener")
    await asyncio.sleep(0.5)  # nothing arrives twice later

    rows = reader.rows
    assert len(rows) == len(set(rows)) == sum(rows_per_id.values())  # exactly once
    got = [row[1] for row in rows]
    assert got == sorted(got)  # in order
    assert set(got) == set(ids)
    assert metric(r, "plait_stream_position", stream="events", writer="w1") == last
    assert reader.rows_after_departure == 0  # the departure came after its rows
    if inbound_queue < BURST:
        assert metric(r, "plait_inbound_overflows_total", stream="events") >= 1


@pytest.mark.parametrize("inbound_queue", [100_000, 50], ids=["within-bound", "past-bound"])
async def test_a_hub_that_reads_slowly_delivers_a_departed_clients_queued_rows(
    db: Database, inbound_queue: int
) -> None:
    """The hub is the slow reader: the departing writer's connection ends while its rows
    still wait in the hub's queue. They are the hub's to deliver all the same (nobody
    sends them again: the writer is gone)."""
    async with cluster_of(db, "tcp", hub="hub") as cluster:
        reader = SlowRows()
        hub = cluster.instance("hub", replication={"inbound_queue": inbound_queue})
        hub.on_rows("events", reader.on_rows_slowly)
        hub.on_departure(reader.departed.append)
        await cluster.start(hub)
        w1 = await cluster.start(cluster.instance("w1"))
        await connected(hub, w1)

        ids = [await write(w1, "first")]
        ids += await write_many(w1, BURST, "w1-")
        gen = w1.generator("events")
        await w1.stop()  # sends what is left, then DEPART, then hangs up
        last = gen.get_current_token_for_writer("w1")

        def received(command: str) -> float:
            return metric(hub, "plait_commands_received_total", command=command)

        try:
            await pace.until(lambda: received("DEPART") >= 1, 30, "the DEPART of w1")
            await pace.until(
                lambda: metric(hub, "plait_connection_up", link="tcp:w1") == 0,
                30,
                "the hub to see w1's connection end",
            )
        finally:
            reader.release.set()

        await reader.wait(len(ids), within=60)
        assert await hub.wait_for_stream_position("w1", "events", last, timeout=30), (
            "the hub's position of w1 never reached w1's last"
        )
        await pace.until(lambda: reader.departed == ["w1"], 30, "the departure listener")
        await asyncio.sleep(0.5)
        got = [row[1] for row in reader.rows]
        assert got == sorted(set(got))
        assert set(got) == set(ids)


class RefusesPoison(TableRows):
    """Refuses the row `poison.0` as it comes over the wire (a codec that changed, say);
    from the database it reads it."""

    def from_json(self, value: Any) -> tuple[str, int, str, str]:
        if value[3] == "poison.0":
            raise ValueError("this codec refuses poison.0")
        return super().from_json(value)


class RefusesPoisonEverywhere(RefusesPoison):
    """Refuses `poison.0` from the database too, while `broken`."""

    def __init__(self) -> None:
        self.broken = True

    def from_db(self, row: StreamRow) -> tuple[str, int, str, str]:
        if self.broken and row.data["payload"] == "poison.0":
            raise ValueError("this codec refuses poison.0 from the database too")
        return super().from_db(row)


async def _w1_and_a_reader_refusing_poison(
    cluster: Cluster,
    on_rows: Callable[..., Any],
    row_type: TableRows | None = None,
    on_departure: Callable[[str], Any] | None = None,
) -> tuple[Instance, Instance]:
    """w1, and a reader "r" whose row type refuses `poison.0` (`RefusesPoison` unless
    given), connected (through the hub over TCP)."""
    others = [await cluster.start(cluster.instance("hub"))] if cluster.transport == "tcp" else []
    w1 = await cluster.start(cluster.instance("w1"))
    r = cluster.instance("r")
    r.row_type("events", row_type or RefusesPoison())
    r.on_rows("events", on_rows)
    if on_departure is not None:
        r.on_departure(on_departure)
    await cluster.start(r)
    await connected(*others, w1, r)
    return w1, r


async def _release_once_departed(r: Instance, reader: SlowRows) -> None:
    """Let `reader`'s `on_rows` go on once `r` received w1's DEPART (queued behind its
    rows), or, failing that, before the wait's error is raised."""
    try:
        await pace.until(
            lambda: metric(r, "plait_commands_received_total", command="DEPART") >= 1,
            30,
            "the DEPART of w1",
        )
    finally:
        reader.release.set()


async def test_a_row_that_fails_to_arrive_is_read_from_the_database_though_its_writer_left(
    cluster: Cluster,
) -> None:
    """Handling a queued row failed after its writer had departed: the reader tries it
    again from the database instead of dropping the rows queued behind it (nobody sends
    them again)."""
    reader = SlowRows()
    w1, r = await _w1_and_a_reader_refusing_poison(cluster, reader.on_rows_slowly)

    ids = [await write(w1, "first"), await write(w1, "poison")]
    ids += await write_many(w1, 50, "w1-")
    gen = w1.generator("events")
    await w1.stop()
    last = gen.get_current_token_for_writer("w1")
    await _release_once_departed(r, reader)
    await reader.wait(len(ids), within=60)
    assert await r.wait_for_stream_position("w1", "events", last, timeout=30), "w1's last position"
    got = [row[1] for row in reader.rows]
    assert got == sorted(set(got))
    assert set(got) == set(ids)
    assert ("events", ids[1], "w1", "poison.0") in reader.rows  # as the database has it


async def test_a_reader_that_gives_up_a_failing_row_gets_it_when_its_writer_comes_back(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row that cannot be handled for `_RETRY_FOR` s (shortened here) is given up, with
    the commands queued behind it, said at ERROR; the writer's departure queued among
    them still reaches the departure listeners. What was given up arrives, once and in
    order, when the writer speaks again (a restart: its next POSITION)."""
    monkeypatch.setattr(retries, "RETRY_FOR", 1.0)
    reader = SlowRows()
    codec = RefusesPoisonEverywhere()
    departed: list[str] = []
    w1, r = await _w1_and_a_reader_refusing_poison(
        cluster, reader.on_rows_slowly, codec, departed.append
    )

    ids = [await write(w1, "first"), await write(w1, "poison")]
    ids += await write_many(w1, 20, "w1-")
    await w1.stop()
    await _release_once_departed(r, reader)
    await pace.until(lambda: "giving up the commands" in caplog.text, 60, "the give-up")
    await pace.until(lambda: departed == ["w1"], 30, "the departure listener")
    assert [row[1] for row in reader.rows] == ids[:1]  # nothing past the row given up
    assert any(
        rec.levelname == "ERROR" and "failed for 1 s" in rec.getMessage() for rec in caplog.records
    )

    codec.broken = False
    w1 = await cluster.start(cluster.instance("w1"))
    ids.append(await write(w1, "later"))
    await reader.wait(len(ids), within=60)
    await asyncio.sleep(0.3)  # nothing arrives twice later
    got = [row[1] for row in reader.rows]
    assert got == ids
    assert ("events", ids[1], "w1", "poison.0") in reader.rows


async def test_a_batch_whose_row_fails_on_the_fast_path_is_read_whole_from_the_database(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A plain-function listener gets live rows without a queue. When the codec refuses
    a row of a batch there, the whole batch is read from the database: the rows held
    before the numbered one are not lost."""
    seen = Seen()
    w1, r = await _w1_and_a_reader_refusing_poison(cluster, seen.on_rows)

    first = await write(w1, "first")
    poisoned = await write(w1, "poison", rows=3)  # poison.0 is refused, the batch's first
    after = await write(w1, "after")
    await seen.wait(5, within=30)
    assert await r.wait_for_stream_position("w1", "events", after, timeout=30), "w1's last row"
    await asyncio.sleep(0.3)  # nothing arrives twice later
    assert sorted(seen.rows) == sorted(
        [
            ("events", first, "w1", "first.0"),
            *[("events", poisoned, "w1", f"poison.{i}") for i in range(3)],
            ("events", after, "w1", "after.0"),
        ]
    )
    assert "the row type of events refuses (ValueError: this codec refuses poison.0" in caplog.text
