"""A one-row data source that tells whether Spark's Python workers can import what a
plait read needs (`plait.spark.check_executors`): planned by the driver's workers and
read by an executor's, as plait's own reads are, so it finds the Python they use
whichever way it was chosen (PYSPARK_PYTHON, spark.pyspark.python, an archive)."""

from __future__ import annotations

import importlib
import re
import sys
import threading
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from plait.errors import ConfigError

# What the workers' Python must import to read rows.
NEEDED = ("plait.spark.source", "pyarrow", "adbc_driver_postgresql")
# How long the check waits for an executor (one may still be starting, or queued).
WITHIN = 120.0
_FIX = (
    "install plait[spark] in it on every node, or set spark.pyspark.python (or "
    "PYSPARK_PYTHON) to a Python that has it (docs: Spark on a cluster)"
)


def check(spark: Any, within: float = WITHIN) -> None:
    """On a cluster (not local mode, not Spark Connect, whose server is its own), read
    one row through `Probe`, planned and read by the same Python workers as plait's
    reads; `ConfigError` saying what to do when they cannot import plait. Spark ships
    no installed packages, and without this the first read fails with a long traceback
    ending in "No module named 'plait'"; plait cannot ship itself (pyarrow and the ADBC
    driver are compiled). When no executor answers within `within` seconds, the check
    is given up with a warning: the reads will wait for executors as any job does."""
    try:
        context = spark.sparkContext
    except Exception:  # Spark Connect: no SparkContext in the client
        return
    if str(context.master).startswith("local"):
        return  # the workers run this machine's Python (plait.spark.session sees to it)
    spark.dataSource.register(Probe)
    group = f"plait-probe-{uuid.uuid4().hex[:8]}"
    keys = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")
    previous = {key: context.getLocalProperty(key) for key in keys}
    context.setJobGroup(group, "plait: can Spark's Python workers import plait?", True)
    timer = threading.Timer(within, context.cancelJobGroup, (group,))
    timer.start()
    try:
        rows = spark.read.format(Probe.name()).load().collect()
    except Exception as err:
        program = cannot_run(str(err))
        if program is not None:
            from plait.spark.session import driver_python_problem

            raise ConfigError(
                driver_python_problem(program)
                or f"Spark's executors cannot start the workers' Python {program}: {_FIX}"
            ) from None
        reason = missing(str(err))
        if reason is not None:
            raise ConfigError(
                f"Spark's Python workers cannot import what a plait read needs ({reason}): "
                + _FIX.replace("in it", "in the Python they run")
            ) from None
        if not timer.is_alive():  # cancelled: no executor within the time
            warnings.warn(
                f"plait: no executor ran the check that plait imports there within "
                f"{within:.0f} s; going on without it",
                stacklevel=3,
            )
            return
        raise
    finally:
        timer.cancel()
        for key, value in previous.items():  # the caller's jobs are not ours
            context.setLocalProperty(key, value)
    if rows and rows[0].problem:
        raise ConfigError(
            f"the executors' Python ({rows[0].python}) cannot import what a plait read "
            f"needs ({rows[0].problem}); {_FIX}"
        )


class Probe(DataSource):
    @classmethod
    def name(cls) -> str:
        return "plait_probe"

    def schema(self) -> str:
        return "python string, problem string"

    def reader(self, schema: object) -> DataSourceReader:
        return ProbeReader()


class ProbeReader(DataSourceReader):
    def partitions(self) -> list[InputPartition]:
        return [InputPartition(0)]

    def read(self, partition: InputPartition) -> Iterator[tuple[str, str | None]]:
        for name in NEEDED:
            try:
                importlib.import_module(name)
            except Exception as err:  # ImportError, or a broken installation
                yield sys.executable, f"{type(err).__name__}: {err}"
                return
        yield sys.executable, None


_MISSING = re.compile(r"((?:ModuleNotFoundError|ImportError): [^\n]{1,300})")


_CANNOT_RUN = re.compile(r'Cannot run program "([^"\n]{1,500})"')


def cannot_run(error: str) -> str | None:
    """The program Spark could not start (the workers' Python), from a Spark error."""
    found = _CANNOT_RUN.search(error)
    return found.group(1) if found else None


def missing(error: str) -> str | None:
    """The import error in the text of a Spark error, if that is what it was."""
    found = _MISSING.findall(error)
    return found[-1].strip() if found else None
