"""Ready pipelines on the `plait` source, each exactly once across restarts through a
Spark checkpoint (SPEC §8):

- `export`: a stream to a Parquet dataset (Spark's file sink, whose log in the output
  folder lists only committed batches) or to a Delta Lake table (`plait.spark.delta`:
  executors write the files, the driver commits them with the `deltalake` package, the
  batch id recorded as an application transaction: a replayed batch finds its id
  recorded and writes nothing).
- `derive`: a PostgreSQL table kept from a stream, the latest row per key or counts per
  key and hour, each batch applied in one transaction together with a marker row
  `(job, batch_id)`: a replayed batch finds its marker and changes nothing.

Each prints one line per batch (rows, offsets, seconds) through a query listener.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TextIO

import plait.spark
from plait.errors import ConfigError
from plait.spark.delta import DeltaBatches
from plait.storage import derived_tables


@dataclass(frozen=True, slots=True)
class Source:
    dsn: str
    stream: str
    table: str | None = None
    starting: str = "earliest"
    max_rows: int | None = None
    min_rows: int | None = None
    max_delay: str | None = None  # "15m", as the source's maxTriggerDelay takes it

    def frame(self, spark: Any) -> Any:
        options: dict[str, Any] = {"startingToken": self.starting}
        if self.table:
            options["table"] = self.table
        if self.max_rows:
            options["maxRowsPerTrigger"] = self.max_rows
        if self.min_rows:
            options["minRowsPerTrigger"] = self.min_rows
        if self.max_delay:
            options["maxTriggerDelay"] = self.max_delay
        return plait.spark.stream(spark, self.dsn, self.stream, **options)


def progress_printer(spark: Any, out: TextIO = sys.stderr) -> Any:
    """One line per micro-batch of every query of this session; returns the listener,
    whose `rows` counts the rows of the batches it printed."""
    from pyspark.sql.streaming.listener import StreamingQueryListener

    class Printer(StreamingQueryListener):
        rows = 0

        def onQueryStarted(self, event: Any) -> None:
            pass

        def onQueryProgress(self, event: Any) -> None:
            p = event.progress
            if not p.numInputRows and not p.sources:
                return
            self.rows += p.numInputRows or 0
            end = p.sources[0].endOffset if p.sources else None
            seconds = (p.durationMs or {}).get("triggerExecution", 0) / 1000
            print(
                f"batch {p.batchId}: {p.numInputRows} rows in {seconds:.2f} s, up to {end}",
                file=out,
                flush=True,
            )

        def onQueryIdle(self, event: Any) -> None:
            pass

        def onQueryTerminated(self, event: Any) -> None:
            if event.exception:
                print(f"query failed: {event.exception.splitlines()[0]}", file=out, flush=True)

    printer = Printer()
    spark.streams.addListener(printer)
    return printer


def _trigger(writer: Any, once: bool) -> Any:
    return writer.trigger(availableNow=True) if once else writer.trigger(processingTime="1 second")


def _partitioned(frame: Any, by: str | None, by_date: str | None) -> tuple[Any, list[str]]:
    if by and by_date:
        raise ConfigError("partition by a column or by the date of a column, not both")
    if by_date:
        from pyspark.sql import functions as f

        if by_date not in frame.columns:
            raise ConfigError(
                f"no column {by_date!r} to take the date of; columns: {frame.columns}"
            )
        return frame.withColumn("date", f.to_date(f.col(by_date))), ["date"]
    if by:
        if by not in frame.columns:
            raise ConfigError(f"no column {by!r} to partition by; columns: {frame.columns}")
        return frame, [by]
    return frame, []


def export(
    spark: Any,
    source: Source,
    *,
    to: Literal["parquet", "delta"],
    path: str,
    checkpoint: str,
    partition_by: str | None = None,
    partition_by_date: str | None = None,
    once: bool = False,
) -> Any:
    """Start exporting `source` to `path`; returns the StreamingQuery."""
    frame, partitions = _partitioned(source.frame(spark), partition_by, partition_by_date)
    if to == "parquet":
        writer = frame.writeStream.format("parquet").option("path", path)
        if partitions:
            writer = writer.partitionBy(*partitions)
    elif to == "delta":
        writer = frame.writeStream.foreachBatch(DeltaBatches(path, checkpoint, partitions))
    else:
        raise ConfigError(f"unknown export target {to!r}: parquet or delta")
    writer = writer.option("checkpointLocation", checkpoint).queryName(f"export-{source.stream}")
    return _trigger(writer, once).start()


# -- derived tables --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Derived:
    """A table kept from a stream: `latest` (the last row of each key, as JSON, with
    its stream ID) or `counts` (rows per key and hour of `time_column`)."""

    dsn: str
    table: str
    key: str
    kind: Literal["latest", "counts"] = "latest"
    time_column: str = "at"
    job: str = ""

    @property
    def job_name(self) -> str:
        return self.job or f"derive:{self.table}"

    def create(self) -> None:
        derived_tables.create(self.dsn, self.table, self.kind)

    def batch_rows(self, frame: Any) -> list[tuple[Any, ...]]:
        """What this batch changes, computed by Spark: (key, stream_id, instance, json)
        for `latest`, (key, hour, count) for `counts`."""
        from pyspark.sql import functions as f

        if self.key not in frame.columns:
            raise ConfigError(f"no key column {self.key!r}; columns: {frame.columns}")
        if self.kind == "latest":
            row = f.to_json(f.struct(*[f.col(c) for c in frame.columns]))
            latest = frame.groupBy(f.col(self.key).cast("string").alias("key")).agg(
                f.max_by(
                    f.struct(f.col("stream_id"), f.col("instance_name"), row.alias("row")),
                    f.col("stream_id"),
                ).alias("last")
            )
            rows = latest.select("key", "last.stream_id", "last.instance_name", "last.row")
        else:
            if self.time_column not in frame.columns:
                raise ConfigError(f"no time column {self.time_column!r}; columns: {frame.columns}")
            rows = frame.groupBy(
                f.col(self.key).cast("string").alias("key"),
                f.date_trunc("hour", f.col(self.time_column)).alias("hour"),
            ).count()
        return [tuple(r) for r in rows.collect()]

    def apply(self, rows: list[tuple[Any, ...]], batch_id: int) -> bool:
        """Apply one batch's rows with its marker, in one transaction; False when the
        marker was there already (a replayed batch)."""
        return derived_tables.apply(self.dsn, self.table, self.kind, self.job_name, rows, batch_id)

    def __call__(self, frame: Any, batch_id: int) -> None:
        self.apply(self.batch_rows(frame), batch_id)


def derive(
    spark: Any, source: Source, target: Derived, *, checkpoint: str, once: bool = False
) -> Any:
    """Start keeping `target` from `source`; returns the StreamingQuery."""
    target.create()
    writer = (
        source.frame(spark)
        .writeStream.foreachBatch(target)
        .option("checkpointLocation", checkpoint)
        .queryName(f"derive-{target.table}")
    )
    return _trigger(writer, once).start()


def run(query: Any, on_stop: Callable[[], None] | None = None) -> bool:
    """Wait for a query to end (Ctrl-C stops it cleanly), then `on_stop` (stopping the
    session there lets the last progress lines reach the listener first). True when
    it ended by itself (Trigger.AvailableNow), False when stopped by Ctrl-C."""
    failure = None
    try:
        query.awaitTermination()
    except KeyboardInterrupt:
        query.stop()
        return False
    else:
        failure = query.exception()  # asked before `on_stop`: a Connect session is gone after
    finally:
        if on_stop is not None:
            on_stop()
    if failure is not None:
        raise RuntimeError(str(failure).splitlines()[0])
    return True
