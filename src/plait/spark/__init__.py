"""plait streams in Spark (SPEC §8).

`register(spark)` adds the `plait` data source to a SparkSession; `batch(...)` and
`stream(...)` check the options first (a bad one raises `ConfigError` with one clear
line, instead of Spark's wrapped traceback) and load the DataFrame.
"""

from __future__ import annotations

from typing import Any

# Spark calls a Python source's `pushFilters` only with this on (it is off by default).
PUSHDOWN = "spark.sql.python.filterPushdown.enabled"


def register(spark: Any) -> None:
    """Make `spark.read.format("plait")` and `spark.readStream.format("plait")` work in
    this SparkSession, and turn on filter pushdown for Python sources unless the
    session turned it off (batch reads push filters into their SQL:
    `plait.spark.pushdown`). On a cluster, first checks that the executors can import
    plait (`check_executors`)."""
    from plait.spark.source import PlaitSource

    if spark.conf.get(PUSHDOWN, None) is None:  # None: not set, Spark's default (off)
        spark.conf.set(PUSHDOWN, "true")
    spark.dataSource.register(PlaitSource)
    check_executors(spark)


def check_executors(spark: Any) -> None:
    """On a cluster, whether Spark's Python workers can import plait (`probe.check`)."""
    from plait.spark import probe

    probe.check(spark)


def batch(spark: Any, dsn: str, stream: str, **options: Any) -> Any:
    """`spark.read.format("plait")...load()`, options checked first (startToken,
    endToken, table, maxIdsPerPartition, partitioning)."""
    reader = spark.read.format("plait")
    return _with(reader, _checked(dsn, stream, options, batch=True)).load()


def stream(spark: Any, dsn: str, stream: str, **options: Any) -> Any:
    """`spark.readStream.format("plait")...load()`, options checked first
    (startingToken, maxRowsPerTrigger, minRowsPerTrigger, maxTriggerDelay, table,
    maxIdsPerPartition, partitioning)."""
    reader = spark.readStream.format("plait")
    return _with(reader, _checked(dsn, stream, options, batch=False)).load()


def _checked(dsn: str, stream: str, options: dict[str, Any], *, batch: bool) -> dict[str, str]:
    from plait.spark.options import Options
    from plait.spark.plan import Plan
    from plait.storage import catalog

    given = {"dsn": dsn, "stream": stream, **{k: str(v) for k, v in options.items()}}
    parsed = Options.parse(given)
    with catalog.connect(dsn) as conn:  # one of its own: the driver keeps no connection
        run = catalog.OnConnection(conn)
        plan = Plan.load(parsed, run)
        if batch:
            plan.token(parsed.start, "startToken", run)
            plan.token(parsed.end, "endToken", run)
        else:
            plan.token(parsed.starting, "startingToken", run)
    return given


def _with(reader: Any, options: dict[str, str]) -> Any:
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader


__all__ = ["batch", "register", "stream"]
