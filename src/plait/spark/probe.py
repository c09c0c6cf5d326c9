"""A one-row data source that tells whether Spark's Python workers can import what a
plait read needs (`plait.spark.check_executors`): planned by the driver's workers and
read by an executor's, as plait's own reads are, so it finds the Python they use
whichever way it was chosen (PYSPARK_PYTHON, spark.pyspark.python, an archive)."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterator

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

# What the workers' Python must import to read rows.
NEEDED = ("plait.spark.source", "pyarrow", "adbc_driver_postgresql")


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


def missing(error: str) -> str | None:
    """The import error in the text of a Spark error, if that is what it was."""
    found = _MISSING.findall(error)
    return found[-1].strip() if found else None
