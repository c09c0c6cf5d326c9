"""What one Spark task runs: the SELECT of its slice (`RangePartition`), read over ADBC
as Arrow record batches of the schema's types."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypeVar

from pyspark.sql.datasource import InputPartition
from pyspark.sql.types import StructType

from plait.spark import workers
from plait.spark.read_connections import ReadConnections
from plait.storage.timeouts import DEFAULT_TIMEOUTS

T = TypeVar("T")


class RangePartition(InputPartition):
    """One task's rows: a SELECT over one slice of the ID space."""

    def __init__(self, query: str) -> None:
        super().__init__(query)
        self.query = query


def _adbc(dsn: str) -> Any:
    import adbc_driver_postgresql.dbapi as adbc

    # ADBC takes a DSN only: the keepalives go in it (what the DSN sets itself wins).
    return adbc.connect(DEFAULT_TIMEOUTS.client_dsn(dsn), autocommit=True)


_READS = ReadConnections(_adbc)


@contextlib.contextmanager
def _closing(thing: T) -> Iterator[T]:
    """`contextlib.closing`, except that after a failure a failing `close()` (of a
    connection that broke) does not hide the failure that matters."""
    try:
        yield thing
    except BaseException:
        with contextlib.suppress(Exception):
            thing.close()  # type: ignore[attr-defined]
        raise
    thing.close()  # type: ignore[attr-defined]


def read_arrow(dsn: str, query: str, schema: StructType) -> Iterator[Any]:
    """The rows of `query` as Arrow record batches of `schema`'s types, on this worker's
    kept connection when its socket shows it whole, else a new one (`read_connections`:
    the ADBC driver held at 1.8 aborts the process on a query sent over a broken one).
    A connection that fails while rows arrive raises, and Spark tries the task again."""
    from pyspark.sql.pandas.types import to_arrow_schema

    target = to_arrow_schema(schema, timezone="UTC")  # as Spark reads them back
    with _READS.connection(dsn) as conn, _closing(conn.cursor()) as cursor:
        cursor.execute(query)
        workers.settle()  # everything this worker needs is loaded by now
        for batch in cursor.fetch_record_batch():
            if not batch.schema.equals(target, check_metadata=False):
                batch = batch.cast(target, safe=False)  # numeric text to decimal, and such
            yield batch
