"""The `plait` data source for PySpark: any plait stream, in batch or as a Structured
Streaming source, exactly once (SPEC §8).

    plait.spark.register(spark)
    spark.readStream.format("plait").option("dsn", dsn).option("stream", "events").load()

Options: `dsn` and `stream` (required); `table` (streams over several tables);
`startingToken` (streaming: "earliest", the default, "latest", a token or an offset);
`startToken` / `endToken` (batch: default earliest and latest); `maxRowsPerTrigger`;
`minRowsPerTrigger` with `maxTriggerDelay` (streaming: a trigger reads nothing until
that many rows are pending or the last batch is that long ago, default 15m, as in the
Kafka source);
`maxIdsPerPartition` (default 250 000: the IDs a batch reads are cut into equal slices
of at most that many, one task each, but never more than 10 000 slices: past that they
are wider); `partitioning` (`slices`, the default: a task reads one slice of the ID
space for every writer at once; `writers`: a task per writer range, cut into pieces of
at most `maxIdsPerPartition` IDs, with the same cap); `metadataColumns` (a
comma-separated list: `stream` adds `_stream`, the stream's name; `commitTimestamp` adds
`_commit_timestamp`, when the row's transaction committed, where PostgreSQL records it:
track_commit_timestamp = on).

Tokens and the offsets Spark hands back from a checkpoint are checked against the
stream before anything is planned by them: a position above the stream's sequence head
(a checkpoint or token of another database or deployment, or from before the stream was
recreated) or a writer the stream does not have is a clear error saying what to do; so is
an option the source does not know (a misspelt one would be ignored otherwise).

Offsets come from `stream_positions` (never past what a writer persisted), so an idle
writer or one holding a transaction open never holds back the others. Rows reach Spark
as Arrow record batches straight from the ADBC PostgreSQL driver (libpq and binary
COPY), cast to the schema's Arrow types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    Filter,
    InputPartition,
)
from pyspark.sql.types import StructType

from plait.core import offsets
from plait.errors import ConfigError
from plait.spark import pushdown, workers
from plait.spark.options import Options
from plait.spark.plan import Plan, metadata_fields
from plait.spark.schema import infer, text_columns
from plait.spark.streaming import StreamReader
from plait.spark.task_reads import RangePartition, read_arrow
from plait.storage.filters import all_of

T = TypeVar("T")
NAME = "plait"


class PlaitSource(DataSource):
    """`spark.read.format("plait")` and `spark.readStream.format("plait")`."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self._options = Options.parse(options)
        self._plan: Plan | None = None

    def _loaded(self) -> Plan:
        if self._plan is None:
            self._plan = Plan.load(self._options)
        workers.settle()  # Spark plans in workers of its own, reused like the others
        return self._plan

    def schema(self) -> StructType:
        plan = self._loaded()
        fields = infer(list(plan.columns)).fields + metadata_fields(plan.options.metadata)
        return StructType(fields)

    def reader(self, schema: StructType) -> DataSourceReader:
        plan = self._loaded()
        text_columns(list(plan.columns), plan.table_part(schema))  # a bad user schema fails here
        return BatchReader(plan, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        plan = self._loaded()
        text_columns(list(plan.columns), plan.table_part(schema))
        return StreamReader(plan, schema)


class _Pushdown:
    """A reader's `pushFilters` that Spark runs when filter pushdown is on, and that
    does not make it refuse the read when it is off.

    Spark calls `pushFilters` only with spark.sql.python.filterPushdown.enabled
    (`plait.spark.register` turns it on), and refuses to read a source whose reader
    overrides it while that is off, which it is wherever the session's own settings do
    not reach: a query planned from another thread (`df.rdd` in a worker thread) sees
    Spark's defaults. Reading without pushdown gives the same rows (Spark applies every
    filter itself), so Spark's check is told it is the base method."""

    __func__ = staticmethod(DataSourceReader.pushFilters)  # what Spark's check compares

    def __init__(self, push: Callable[[list[Filter]], Iterable[Filter]]) -> None:
        self._push = push

    def __call__(self, filters: list[Filter]) -> Iterable[Filter]:
        return self._push(filters)


class BatchReader(DataSourceReader):
    """The rows between two tokens (default: everything persisted now)."""

    def __init__(self, plan: Plan, schema: StructType) -> None:
        self._plan = plan
        self._schema = schema
        start = plan.token(plan.options.start, "startToken")
        end = plan.token(plan.options.end, "endToken")
        if not start.is_before_or_eq(end):
            raise ConfigError(
                f"plait source: endToken {offsets.to_json(end)} is before startToken "
                f"{offsets.to_json(start)} for some writer"
            )
        self._start, self._end = start, end
        self._where: str | None = None  # the pushed filters, as SQL

    @property
    def pushFilters(self) -> Callable[[list[Filter]], Iterable[Filter]]:
        return _Pushdown(self._push)

    def _push(self, filters: list[Filter]) -> Iterable[Filter]:
        """Filters PostgreSQL applies exactly as Spark would (`pushdown`) go into each
        task's SQL, so only matching rows are read; the others stay with Spark."""
        pushed, kept = pushdown.push(filters, pushdown.targets(self._plan.columns, self._schema))
        self._where = all_of(pushed)
        return kept

    def partitions(self) -> list[InputPartition]:
        return list(self._plan.partitions(self._schema, self._start, self._end, self._where))

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, RangePartition)
        return read_arrow(self._plan.options.dsn, partition.query, self._schema)
