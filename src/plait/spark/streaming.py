"""The plait source as a Structured Streaming source (`StreamReader`): micro-batches of
per-writer ranges between offsets read from `stream_positions`, with the Kafka
source's trigger limits."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from plait.core import offsets
from plait.core.tokens import StreamToken
from plait.spark.kept import Kept
from plait.spark.plan import Plan
from plait.spark.task_reads import RangePartition, read_arrow
from plait.storage import catalog


def holds_back(
    now: float, last_batch: float | None, max_delay: float, enough: Callable[[], bool]
) -> bool:
    """Whether a trigger waits for more rows: the Kafka source's rule for
    minOffsetsPerTrigger. The query's first trigger never waits (a restarted query
    reads its backlog at once); later ones wait while fewer than the minimum are
    pending (`enough()`, asked only then) and the last batch is less than `max_delay`
    seconds ago."""
    if last_batch is None or now - last_batch >= max_delay:
        return False
    return not enough()


# How far a trigger cut short by maxRowsPerTrigger counts the rows it leaves behind:
# ten batches of that size, and never more than ROWS_BEHIND_MOST index entries in all
# (the count runs on the driver at every such trigger).
ROWS_BEHIND_BATCHES = 10
ROWS_BEHIND_MOST = 100_000


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of per-writer ranges between offsets read from stream_positions.

    Spark keeps this object on the driver for the whole query and asks it for offsets
    every trigger, over one kept connection."""

    def __init__(self, plan: Plan, schema: StructType) -> None:
        self._plan = plan
        self._schema = schema
        self._target: StreamToken | None = None  # Trigger.AvailableNow: stop here
        self._latest: StreamToken | None = None
        self._last_batch: float | None = None  # monotonic: when a trigger last read rows
        self._behind: dict[str, int] | None = None  # rows per writer past the last end
        self._behind_capped = False
        self._counted: tuple[StreamToken, StreamToken, int] | None = None  # what it was for

    def initialOffset(self) -> dict[str, Any]:
        return self._plan.offset(self._plan.token(self._plan.options.starting, "startingToken"))

    def getDefaultReadLimit(self) -> ReadLimit:
        """ReadMaxRows, else ReadMinRows, else ReadAllAvailable. Spark hands a trigger
        ReadAllAvailable instead when it must read everything (Trigger.Once): no wait
        for minRowsPerTrigger then. A minimum given with a maximum is kept here."""
        options = self._plan.options
        if options.max_rows is not None:
            return ReadMaxRows(options.max_rows)
        if options.min_rows is not None:
            return ReadMinRows(options.min_rows)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._now()

    def _now(self) -> StreamToken:
        spec = self._plan.spec
        self._latest = self._plan.ask(lambda conn: catalog.latest(conn, spec))
        return self._latest

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        (begin,) = self._plan.checked(start)
        latest = self._target if self._target is not None else self._now()
        end = begin.copy_and_advance(latest)  # never behind the start for any writer
        spec, table, pending = self._plan.spec, self._plan.table, offsets.ranges(begin, end)
        if pending and self._waits(pending, limit):
            min_rows = self._plan.options.min_rows
            assert min_rows is not None
            # Fewer than min_rows are pending: each range counted up to it is exact.
            self._count_behind(begin, latest, min_rows, each=True)
            return self._plan.offset(begin)  # no new batch yet
        budget = 0  # nothing is behind unless a limit cut the batch short
        if isinstance(limit, ReadMaxRows):
            cut = self._plan.ask(
                lambda conn: catalog.cutoff(conn, spec, table, pending, limit.max_rows)
            )
            if cut is not None:
                end = offsets.limited(begin, end, cut)
                budget = min(ROWS_BEHIND_BATCHES * limit.max_rows, ROWS_BEHIND_MOST)
        self._count_behind(end, latest, budget)
        if pending:
            self._last_batch = time.monotonic()
        return self._plan.offset(end)

    def _count_behind(
        self, end: StreamToken, latest: StreamToken, budget: int, *, each: bool = False
    ) -> None:
        """The rows per writer between `end` and `latest`, for the query's progress
        (`reportLatestOffset`): at most `budget` index entries in all, shared out over
        the writers' ranges (`each`: up to `budget` in every range); 0 counts none."""
        if self._counted == (end, latest, budget):
            return  # a trigger held back again with nothing new: the same count
        self._counted = (end, latest, budget)
        known = self._plan.spec.writers
        behind = offsets.per_writer(offsets.ranges(end, latest), known)
        cap = budget if each or not behind else -(-budget // len(behind))
        counts: list[int] = []
        if behind and cap > 0:
            spec, table = self._plan.spec, self._plan.table
            counts = self._plan.ask(
                lambda conn: catalog.pending_counts(conn, table, spec.backwards, behind, cap)
            )
        else:
            behind = []
        self._behind = offsets.rows_behind(known, behind, counts)
        self._behind_capped = cap > 0 and any(n >= cap for n in counts)

    def _waits(self, pending: list[offsets.WriterRange], limit: ReadLimit) -> bool:
        """Whether this trigger reads nothing yet (`holds_back`); never when Spark asks
        for everything (Trigger.Once, Trigger.AvailableNow: they must reach the end)."""
        options = self._plan.options
        if options.min_rows is None or self._target is not None:
            return False
        if isinstance(limit, ReadAllAvailable):
            return False
        spec, table, at_least = self._plan.spec, self._plan.table, options.min_rows
        return holds_back(
            time.monotonic(),
            self._last_batch,
            options.max_delay,
            lambda: self._plan.ask(
                lambda conn: catalog.cutoff(conn, spec, table, pending, at_least) is not None
            ),
        )

    def reportLatestOffset(self) -> dict[str, Any] | None:
        """What the last trigger found, for the query's progress (`latestOffset`), with
        `rowsBehind`: the rows per writer the batch left for later triggers (counted up
        to ROWS_BEHIND_BATCHES batches' worth; `rowsBehindAtLeast` when cut there)."""
        if self._latest is None:
            return None
        report = self._plan.offset(self._latest)
        if self._behind is not None:
            report["rowsBehind"] = self._behind
            if self._behind_capped:
                report["rowsBehindAtLeast"] = True
        return report

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        begin, until = self._plan.checked(start, end)
        return list(self._plan.partitions(self._schema, begin, until))

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, RangePartition)
        return read_arrow(self._plan.options.dsn, partition.query, self._schema)

    def commit(self, end: dict[str, Any]) -> None:
        pass  # nothing is kept per offset

    def stop(self) -> None:
        Kept(self._plan.options.dsn).forget()
