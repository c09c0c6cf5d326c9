"""The checker's Spark reader: one Structured Streaming query per stream on the `plait`
source, in a process (and JVM) of its own, started with `plait check --spark`.

Its sink is `foreachBatch`, idempotent by batch id as a real sink must be (Spark runs a
batch again after a restart when its commit was not recorded): a batch id seen before
is dropped, and journalled as a violation if its rows differ from the first time,
because the offsets in the checkpoint fix what a batch reads. The orchestrator's
`spark_restart` fault (an order in the control file) stops one query and starts it
again from its checkpoint, first removing its last commit when no batch is in flight,
as a crash between the sink and the commit would: Spark runs that batch again, and the
plait source must read the same rows for it. So exactly once is checked across
restarts, not only within one query.

The reader's position is each query's last committed end offset: its `min` (every
writer's rows up to it are read) journalled under "*" and judged as a linear position,
and each listed writer's own offset, so a per-writer offset that goes back is a
regression too. Rows are journalled under their `instance_name`: a row of the wrong
writer is a phantom, one out of order per writer a violation.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import queue
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.check.error_lines import error_line, worker_start_timed_out
from plait.check.journal import Journal, Kind
from plait.check.plan import Plan, postgres_fault_near, read_control
from plait.check.seen import Seen
from plait.core import offsets
from plait.core.tokens import StreamToken

TRIGGER = "0.5 seconds"
IDLE_WAIT = 2.0  # how long a restart waits for the query to be between two batches
MAX_ROWS_PER_TRIGGER = 20_000  # a backlog is read in several batches, through `cutoff`
MAX_IDS_PER_PARTITION = 5_000  # several slices per batch
REVIVE_FOR = 60.0  # how long a failed query's start is tried again

logger = logging.getLogger("plait.check")


@dataclass
class Batches:
    """The sink's memory: a digest of each batch id's rows, per stream."""

    digests: dict[str, dict[int, str]] = field(default_factory=dict)

    def first_time(self, stream: str, batch_id: int, ids: list[tuple[str, int]]) -> bool | None:
        """True for a new batch, False for a replay with the same rows, None for a
        replay whose rows differ."""
        digest = hashlib.sha256(repr(sorted(ids)).encode()).hexdigest()
        seen = self.digests.setdefault(stream, {})
        before = seen.get(batch_id)
        if before is None:
            seen[batch_id] = digest
            return True
        return False if before == digest else None


def _batches(log: Path) -> int | None:
    """The highest batch id in a checkpoint log folder (offsets or commits)."""
    if not log.is_dir():
        return None
    return max((int(p.name) for p in log.iterdir() if p.name.isdigit()), default=None)


class _Queries:
    """The streaming queries, started and restarted from their checkpoints."""

    def __init__(self, spark: Any, plan: Plan, delivered: queue.SimpleQueue[Any]) -> None:
        self._spark, self._plan, self._delivered = spark, plan, delivered
        self.running: dict[str, Any] = {}
        self._logged: dict[str, int | None] = {}

    def warm_up(self) -> None:
        """Read each stream once as a batch: Spark starts its Python workers and plans
        the source's first query now, not in the middle of the run (20 s on a busy
        machine, all of it a stall)."""
        import plait.spark

        for stream in self._plan.stream_names:
            plait.spark.batch(self._spark, self._plan.dsn, stream).count()

    def start(self, stream: str) -> None:
        import plait.spark

        delivered = self._delivered

        def sink(frame: Any, batch_id: int) -> None:
            rows = frame.select("instance_name", "stream_id").collect()
            delivered.put((stream, batch_id, [(str(w), int(i)) for w, i in rows]))

        frame = plait.spark.stream(
            self._spark,
            self._plan.dsn,
            stream,
            startingToken="earliest",
            maxRowsPerTrigger=MAX_ROWS_PER_TRIGGER,
            maxIdsPerPartition=MAX_IDS_PER_PARTITION,
        )
        checkpoint = self._plan.run_dir / "spark-checkpoints" / stream
        self.running[stream] = (
            frame.writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(checkpoint))
            .queryName(f"check-{stream}")
            .trigger(processingTime=TRIGGER)
            .start()
        )

    def stop_for_restart(self, stream: str) -> tuple[int | None, bool]:
        """Stop the query, to start it again from its checkpoint (`_start_again`). With
        no batch in flight, first remove the last batch's commit, as a crash between
        the sink and the commit would: Spark runs that batch again from the offsets it
        logged, and the sink must get the same rows. (A batch stopped in flight is run
        again by Spark anyway; its commit log is left as it is.) Returns the batch to
        be run again, and whether its commit was removed."""
        query = self.running[stream]
        deadline = time.monotonic() + IDLE_WAIT
        while query.status.get("isTriggerActive") and time.monotonic() < deadline:
            time.sleep(0.02)  # between two triggers, most likely none is in flight
        query.stop()
        checkpoint = self._plan.run_dir / "spark-checkpoints" / stream
        committed, planned = _batches(checkpoint / "commits"), _batches(checkpoint / "offsets")
        removed = False
        if committed is not None and committed == planned:
            last = committed
            (checkpoint / "commits" / str(last)).unlink()
            (checkpoint / "commits" / f".{last}.crc").unlink(missing_ok=True)
            removed = True
        return planned, removed

    def failed(self) -> tuple[str, str] | None:
        """A query that ended by itself: (its stream, its error)."""
        for stream, query in self.running.items():
            if not query.isActive:
                error = query.exception()
                return stream, str(error) if error is not None else "stopped"
        return None

    def committed(self, stream: str) -> StreamToken | None:
        """The end offset of the query's last batch, from its progress."""
        progress = self.running[stream].lastProgress
        if not progress or not progress.get("sources"):
            return None
        batch = progress.get("batchId")
        if self._logged.get(stream) != batch:  # one line per batch, for a failed run's reader
            self._logged[stream] = batch
            seconds = (progress.get("durationMs") or {}).get("triggerExecution", 0) / 1000
            logger.info(
                "%s batch %s: %s rows in %.2f s",
                stream,
                batch,
                progress.get("numInputRows"),
                seconds,
            )
        end = progress["sources"][0].get("endOffset")
        return None if end is None else offsets.from_json(end)

    def stop(self) -> None:
        for query in self.running.values():
            query.stop()


async def _start_again(queries: _Queries, stream: str) -> None:
    """Start a stopped or failed query again from its checkpoint, as a job's supervisor
    would. While PostgreSQL is down or coming back (a PostgreSQL fault) the start fails
    too, since the source reads the stream's writers: try again for a while."""
    deadline = time.monotonic() + REVIVE_FOR
    while True:
        try:
            await asyncio.to_thread(queries.start, stream)
            return
        except Exception as err:
            if time.monotonic() > deadline:
                raise
            logger.warning("starting the query of %s again failed: %s", stream, err)
            await asyncio.sleep(0.5)


async def spark_reader(plan: Plan, name: str) -> None:
    from plait.check.control import Control, read_until_stopped
    from plait.spark.session import quiet_session

    seen = Seen(Journal(plan.journal(name)))
    control = Control(plan)
    spark = await asyncio.to_thread(quiet_session, "plait-check", "local[2]")
    delivered: queue.SimpleQueue[tuple[str, int, list[tuple[str, int]]]] = queue.SimpleQueue()
    queries = _Queries(spark, plan, delivered)
    await asyncio.to_thread(queries.warm_up)
    for s in plan.stream_names:
        await asyncio.to_thread(queries.start, s)
    restarted = 0
    # Queries started again after a failure, until their first batch: the time from the
    # failure to that batch is journalled as the query's restart ("reviving", "revived").
    reviving: set[str] = set()
    seen.journal.write(Kind.STATE, "started")
    print("started", flush=True)
    follow = asyncio.create_task(control.follow())
    read = asyncio.create_task(read_until_stopped(seen, control, "linear"))
    batches = Batches()
    rng = random.Random()

    def take(stream: str, batch_id: int, rows: list[tuple[str, int]]) -> None:
        fresh = batches.first_time(stream, batch_id, rows)
        if fresh is None:
            seen.journal.write(Kind.VIOLATION, "replay", stream, batch_id)
        if not fresh:
            seen.journal.write(Kind.STATE, "replayed", stream, batch_id)
            return
        by_writer: dict[str, list[int]] = {}
        for writer, i in rows:
            by_writer.setdefault(writer, []).append(i)
        for writer, ids in sorted(by_writer.items()):
            seen.rows(stream, writer, sorted(ids))

    while not read.done():
        # Offsets first: a batch's rows are queued before its progress is reported,
        # so every row up to an offset read here is in the queue when it is drained.
        ends = {s: queries.committed(s) for s in plan.stream_names}
        while not delivered.empty():
            take(*delivered.get_nowait())
        for s, end in ends.items():
            if end is not None:
                seen.token(s, "*", end.min)
                for writer in plan.writers:
                    seen.token(s, writer, end.get(writer))
        for s in sorted(reviving):
            if queries.running[s].lastProgress:
                seen.journal.write(Kind.STATE, "revived", s)
                reviving.discard(s)
        if (failure := queries.failed()) is not None:
            stream, error = failure
            cause = json.dumps(f"{stream}: {error_line(error)}")
            logger.error("spark query of %s failed: %s", stream, error)
            if not (
                postgres_fault_near(read_control(plan.control), time.time())
                or worker_start_timed_out(error)
            ):
                seen.journal.write(Kind.STATE, "query-failed", cause)
                break
            # PostgreSQL was restarted or crashed just now (the plait source does not
            # outlast that within a query), or Spark gave up on starting a Python
            # worker (it waits a fixed 10 s for one to connect back, which a loaded
            # machine misses): the query is started again from its checkpoint, as a
            # job's supervisor would; exactly once must hold across it, as across any
            # restart. Down from now until its first batch.
            if stream not in reviving:
                seen.journal.write(Kind.STATE, "reviving", stream, cause)
                reviving.add(stream)
            await _start_again(queries, stream)
        if control.orders("restart", name) > restarted:
            restarted += 1
            stream = rng.choice(plan.stream_names)
            seen.journal.write(Kind.STATE, "restarting", stream)
            batch, removed = await asyncio.to_thread(queries.stop_for_restart, stream)
            await _start_again(queries, stream)
            seen.journal.write(Kind.STATE, "restarted", stream, batch, "replay" if removed else "-")
        await asyncio.sleep(0.1)
    await read
    follow.cancel()
    await asyncio.to_thread(queries.stop)
    await asyncio.to_thread(spark.stop)
