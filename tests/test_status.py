"""`plait status`: the assessment without I/O, then the command on a real database with
a writer that holds a transaction open while another goes ahead."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from plait import Database
from plait.cli import main
from plait.ops.status import assess, pending_ages, rates
from plait.ports import free_port
from plait.storage.stream_records import RecordedStream, WriterRow
from replication_helpers import cluster_of, connected, write
from stream_helpers import create_generator, create_table

WRITERS = ("w1", "w2", "w3")
INSERT = (
    "INSERT INTO events (stream_id, instance_name, payload)"
    " SELECT {id}, %s, 'p' || g FROM generate_series(1, %s) g RETURNING stream_id"
)


@st.composite
def streams(draw: st.DrawFn) -> RecordedStream:
    present = draw(st.lists(st.sampled_from(WRITERS), unique=True))
    rows = tuple(
        WriterRow(w, draw(st.integers(1, 40)), draw(st.floats(0, 100))) for w in sorted(present)
    )
    return RecordedStream("events", WRITERS, draw(st.integers(40, 60)), rows)


@given(streams(), st.floats(0, 100))
def test_the_assessment_follows_the_rules(stream: RecordedStream, stall_after: float) -> None:
    got = assess(stream, stall_after)
    assert [w.writer for w in got.writers] == list(WRITERS)  # configured ones, in order
    positions = [r.position for r in stream.rows]
    if not positions:
        assert got.persisted_up_to is None
        assert not got.stalled
        return
    assert got.persisted_up_to == min(positions)
    assert got.gap == max(positions) - min(positions)
    by_name = {r.writer: r for r in stream.rows}
    for w in got.writers:
        row = by_name.get(w.writer)
        assert w.position == (row.position if row else None)
        assert w.holding == (row is not None and row.position == min(positions) and got.gap > 0)
        assert w.behind == (max(positions) - row.position if row else 0)
    # Stalled exactly when a writer holding the others back has kept its row still too long.
    stuck = [r for r in stream.rows if by_name[r.writer].position == min(positions)]
    expected = got.gap > 0 and any(r.age > stall_after for r in stuck)
    assert got.stalled == expected
    if got.stalled:
        assert got.stalled_by in {r.writer for r in stuck if r.age > stall_after}


def test_idle_writers_level_with_each_other_are_not_stalled() -> None:
    rows = (WriterRow("w1", 10, 500.0), WriterRow("w2", 10, 500.0))
    assert not assess(RecordedStream("events", ("w1", "w2"), 10, rows), 30).stalled


def test_a_writer_ahead_with_an_old_row_stalls_nobody() -> None:
    rows = (WriterRow("w1", 5, 1.0), WriterRow("w2", 9, 500.0))
    got = assess(RecordedStream("events", ("w1", "w2"), 9, rows), 30)
    assert (got.stalled, got.persisted_up_to, got.gap) == (False, 5, 4)
    assert [w.holding for w in got.writers] == [True, False]


def test_rates_are_ids_per_second_between_two_readings() -> None:
    one = assess(RecordedStream("e", ("w1",), 5, (WriterRow("w1", 5, 0),)))
    two = assess(RecordedStream("e", ("w1",), 25, (WriterRow("w1", 25, 0),)))
    assert rates([one], [two], 2.0) == {("e", "w1"): 10.0}
    assert rates([one], [two], 0.0) == {}


def status(dsn: str, *args: str) -> tuple[int, list[dict[str, Any]]]:
    code, out, _ = status_run(["--dsn", dsn, *args])
    return code, out


async def one_stream(dsn: str, *args: str) -> tuple[int, dict[str, Any]]:
    """`plait status` of a database with one stream: the exit code and its report."""
    code, [report] = await asyncio.to_thread(status, dsn, *args)
    return code, report


def status_run(args: list[str]) -> tuple[int, list[dict[str, Any]], str]:
    result = CliRunner().invoke(main, ["status", "--json", *args])
    return (
        result.exit_code,
        [json.loads(line) for line in result.stdout.splitlines()],
        result.stderr,
    )


async def test_status_reports_positions_and_a_stall_by_a_held_transaction(db: Database) -> None:
    await create_table(db)
    w1 = await create_generator(db, ["w1", "w2"], "w1", position_flush_interval=0.1)
    w2 = await create_generator(db, ["w1", "w2"], "w2", position_flush_interval=0.1)
    try:
        await w1.insert(INSERT, ("w1", 3))
        await w2.insert(INSERT, ("w2", 2))
        await w1.flush_position()
        await w2.flush_position()
        code, events = await one_stream(db.dsn)
        assert code == 0
        assert events["name"] == "events"
        assert [w["writer"] for w in events["writers"]] == ["w1", "w2"]
        assert not events["stalled"]
        async with db.transaction() as txn:
            held = await w1.get_next_txn(txn)  # w1 cannot move past this one
            await txn.execute(
                "INSERT INTO events (stream_id, instance_name, payload) VALUES (%s, 'w1', 'x')",
                (held,),
            )
            for _ in range(3):
                async with db.transaction() as other:
                    stream_id = await w2.get_next_txn(other)
                    await other.execute(
                        "INSERT INTO events (stream_id, instance_name, payload)"
                        " VALUES (%s, 'w2', 'y')",
                        (stream_id,),
                    )
            await w2.flush_position()
            await asyncio.sleep(1.2)
            code, events = await one_stream(db.dsn, "--stall-after", "1")
            assert code == 1
            assert events["stalled_by"] == "w1"
            assert events["persisted_up_to"] < held <= events["head"]
            by_writer = {w["writer"]: w for w in events["writers"]}
            assert by_writer["w1"]["holding"]
            assert by_writer["w1"]["age"] >= 1.0
            assert by_writer["w2"]["position"] > held
        await w1.flush_position()  # committed: w1 moves on, the stall is over
        code, events = await one_stream(db.dsn, "--stall-after", "1")
        assert code == 0
        assert events["gap"] == 0
    finally:
        await w1.close()
        await w2.close()


def test_pending_ages_are_read_from_metrics_text() -> None:
    text = (
        "# HELP plait_stream_oldest_unfinished_age_seconds How long.\n"
        "# TYPE plait_stream_oldest_unfinished_age_seconds gauge\n"
        'plait_stream_oldest_unfinished_age_seconds{stream="events",writer="w1"} 2.5\n'
        'plait_stream_position{stream="events",writer="w1"} 7.0\n'
    )
    assert pending_ages(text) == {("events", "w1"): 2.5}
    rows = (WriterRow("w1", 5, 1.0), WriterRow("w2", 9, 1.0))
    got = assess(RecordedStream("events", ("w1", "w2"), 9, rows), 30, pending_ages(text))
    assert [w.pending_age for w in got.writers] == [2.5, None]  # w2: unknown


async def test_status_with_the_config_shows_how_long_a_held_id_has_waited(
    db: Database, tmp_path: Any
) -> None:
    async with cluster_of(db, "tcp", hub="w1") as cluster:
        w1 = await cluster.start(cluster.instance("w1"))
        w2 = await cluster.start(cluster.instance("w2"))
        await connected(w1, w2)
        await write(w1, "a")
        await write(w2, "b")
        gone = f"http://127.0.0.1:{free_port()}"
        config = tmp_path / "deployment.yaml"
        config.write_text(
            json.dumps(
                {
                    "database": db.dsn,
                    "streams": cluster.config("w1")["streams"],
                    "instance_map": {"w1": w1.http_url, "w2": w2.http_url, "gone": gone},
                }
            )
        )
        async with db.transaction() as txn:
            await w1.generator("events").get_next_txn(txn)  # held open
            await write(w2, "c")
            await asyncio.sleep(1.2)
            code, found, errors = await asyncio.to_thread(
                status_run, ["--config", str(config), "--stall-after", "1"]
            )
        events = next(s for s in found if s["name"] == "events")
        by_writer = {w["writer"]: w for w in events["writers"]}
        assert 1.2 <= by_writer["w1"]["pending_age"] < 30
        assert by_writer["w2"]["pending_age"] == 0.0  # nothing pending
        assert events["stalled_by"] == "w1"
        assert code == 1
        assert "no metrics from gone" in errors


async def test_rows_written_counts_rows_between_two_readings(db: Database) -> None:
    from plait.ops import status as ops
    from plait.storage import stream_records

    await create_table(db)
    w1 = await create_generator(db, ["w1"], "w1", position_flush_interval=0.1)

    def reading() -> list[stream_records.RecordedStream]:
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            return stream_records.read(conn)

    def moved(
        streams: list[stream_records.RecordedStream], since: dict[tuple[str, str], int]
    ) -> Any:
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            return stream_records.rows_written(conn, streams, since)

    try:
        await w1.insert(INSERT, ("w1", 1))
        await w1.flush_position()
        before = [ops.assess(s) for s in await asyncio.to_thread(reading)]
        async with w1.get_next() as stream_id, db.transaction() as txn:
            for body in ("a", "b", "c"):  # three rows under one ID
                await txn.execute(
                    "INSERT INTO events (stream_id, instance_name, payload) VALUES (%s, 'w1', %s)",
                    (stream_id, body),
                )
        await w1.insert(INSERT, ("w1", 2))
        await w1.flush_position()
        after = await asyncio.to_thread(reading)
        assert ops.rates(before, [ops.assess(s) for s in after], 1.0) == {("events", "w1"): 3.0}
        rows = await asyncio.to_thread(moved, after, ops.positions(before))
        assert rows == {("events", "w1"): 5}
        same = ops.positions([ops.assess(s) for s in after])
        assert await asyncio.to_thread(moved, after, same) == {}
    finally:
        await w1.close()
