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
    """On a cluster (not local mode, not Spark Connect, whose server is its own), read
    one row through a probe source (`plait.spark.probe`) planned and read by the same
    Python workers as plait's reads; `ConfigError` saying what to do when they cannot
    import plait. Spark ships no installed packages, and without this the first read
    fails with a long traceback ending in "No module named 'plait'". plait cannot ship
    itself: pyarrow and the ADBC driver are compiled."""
    from plait.errors import ConfigError
    from plait.spark.probe import Probe, missing

    try:
        context = spark.sparkContext
    except Exception:  # Spark Connect: no SparkContext in the client
        return
    if str(context.master).startswith("local"):
        return  # the workers run this machine's Python (plait.spark.session sees to it)
    spark.dataSource.register(Probe)
    try:
        rows = spark.read.format(Probe.name()).load().collect()
    except Exception as err:
        reason = missing(str(err))
        if reason is None:
            raise
        raise ConfigError(
            f"Spark's Python workers cannot import what a plait read needs "
            f"({reason}): install plait[spark] in the Python they run on every node, or set "
            "spark.pyspark.python (or PYSPARK_PYTHON) to a Python that has it (README: "
            "Running on a cluster)"
        ) from None
    if rows and rows[0].problem:
        raise ConfigError(
            f"the executors' Python ({rows[0].python}) cannot import what a plait "
            f"read needs ({rows[0].problem}); install plait[spark] in it on every node, or "
            "set spark.pyspark.python (or PYSPARK_PYTHON) to a Python that has it (README: "
            "Running on a cluster)"
        )


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
    from plait.spark import catalog
    from plait.spark.options import Options
    from plait.spark.source import Plan

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
