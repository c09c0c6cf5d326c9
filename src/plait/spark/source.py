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

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    Filter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StringType, StructField, StructType, TimestampType

from plait.core import offsets
from plait.core.spec import StreamSpec, TableSpec
from plait.core.tokens import StreamToken
from plait.errors import ConfigError, TokenParseError
from plait.spark import pushdown, workers
from plait.spark.options import METADATA, Options
from plait.spark.read_connections import ReadConnections
from plait.spark.schema import infer, text_columns
from plait.storage import catalog
from plait.storage.filters import all_of
from plait.storage.timeouts import DEFAULT_TIMEOUTS

T = TypeVar("T")
NAME = "plait"


@dataclass(frozen=True, slots=True)
class Plan:
    """What every reader needs, resolved on the driver once (plain data: picklable)."""

    options: Options
    spec: StreamSpec
    table: TableSpec
    columns: tuple[catalog.Column, ...]
    identity: offsets.Identity  # what this source's offsets are offsets of

    @classmethod
    def load(cls, options: Options, run: catalog.Ask | None = None) -> Plan:
        """The stream's plan, asked on `run` (default: this process's kept connection)."""

        def find(conn: Any) -> Plan:
            spec = catalog.load_spec(conn, options.stream)
            table = catalog.pick_table(spec, options.table)
            identity = offsets.Identity(spec.name, catalog.stream_uid(conn, spec.name))
            columns = tuple(catalog.columns(conn, table))
            _check_metadata(conn, options.metadata, table, columns)
            return cls(options, spec, table, columns, identity)

        return (run or Kept(options.dsn))(find)

    def offset(self, token: StreamToken) -> dict[str, Any]:
        """`token` as an offset of this stream (what Spark keeps in the checkpoint)."""
        return offsets.offset(token, self.identity)

    def ask(self, work: Callable[[Any], T]) -> T:
        """`work(conn)` on this process's kept catalog connection."""
        return Kept(self.options.dsn)(work)

    def token(self, value: str, what: str, run: catalog.Ask | None = None) -> StreamToken:
        """Option `what`'s token, checked against the stream (`catalog.check`)."""
        try:
            return catalog.parse_token(self.spec, value, run or self.ask)
        except catalog.Refused as err:
            raise ConfigError(
                f"plait source: bad {what} {value!r}: {err}; {catalog.FOREIGN_TOKEN}"
            ) from None
        except ConfigError:
            raise  # no connection, or stored positions past the head: said in full
        except ValueError as err:
            raise ConfigError(f"plait source: bad {what} {value!r}: {err}") from None

    def checked(self, *given: dict[str, Any]) -> list[StreamToken]:
        """Offsets Spark hands back (from the checkpoint, maybe of another database),
        parsed and checked against the stream with one read of its sequence head, before
        anything is planned by them."""
        try:
            parsed = [offsets.parse(value) for value in given]
            for _, identity in parsed:
                if why := offsets.foreign(identity, self.identity):
                    raise catalog.Refused(why)
            tokens = [token for token, _ in parsed]
            everything = tokens[0]
            for token in tokens[1:]:
                everything = everything.copy_and_advance(token)  # every writer at its highest
            spec = self.spec
            self.ask(lambda conn: catalog.check(conn, spec, everything))
        except (catalog.Refused, TokenParseError) as err:
            shown = " to ".join(_shown(value) for value in given)
            raise ConfigError(
                f"plait source: the checkpoint's offset {shown} is no offset of stream "
                f"{self.spec.name!r} in this database: {err}; {catalog.FOREIGN_CHECKPOINT}"
            ) from None
        return tokens

    def partitions(
        self, schema: StructType, start: StreamToken, end: StreamToken, where: str | None = None
    ) -> list[RangePartition]:
        """A task per piece of the rows between `start` and `end`; `where` (SQL, from
        pushed filters) narrows each."""
        as_text = set(text_columns(list(self.columns), self.table_part(schema)))
        cut = offsets.by_writer if self.options.by_writer else offsets.slices
        pieces = cut(offsets.ranges(start, end), self.options.max_ids)
        return [RangePartition(self.query(schema, as_text, piece, where)) for piece in pieces]

    def table_part(self, schema: StructType) -> StructType:
        """`schema` without the metadata columns this source adds."""
        added = {METADATA[name] for name in self.options.metadata}
        return StructType([f for f in schema.fields if f.name not in added])

    def query(
        self, schema: StructType, as_text: set[str], piece: offsets.Slice, where: str | None
    ) -> str:
        added = {METADATA[name]: name for name in self.options.metadata}
        return catalog.slice_query(
            self.spec,
            self.table,
            [f.name for f in schema.fields],
            as_text,
            added,
            piece,
            where,
        )


def _check_metadata(
    conn: Any, asked: tuple[str, ...], table: TableSpec, columns: tuple[catalog.Column, ...]
) -> None:
    taken = {column.name for column in columns} & {METADATA[name] for name in asked}
    if taken:
        raise ConfigError(
            f"plait source: table {table.name!r} has a column {sorted(taken)[0]!r}, the name "
            "of a metadata column it asks for: leave that one out of metadataColumns"
        )
    if "commitTimestamp" in asked and not catalog.tracks_commit_timestamps(conn):
        raise ConfigError(
            "plait source: metadataColumns asks for commitTimestamp, and this PostgreSQL does "
            "not record when transactions commit: set track_commit_timestamp = on in its "
            "configuration and restart it (rows committed before that have none)"
        )


def metadata_fields(asked: tuple[str, ...]) -> list[StructField]:
    kinds = {"stream": StringType(), "commitTimestamp": TimestampType()}
    return [StructField(METADATA[name], kinds[name], True) for name in asked]


def _shown(value: object, limit: int = 200) -> str:
    """An offset as Spark gave it, cut short if long (a message is one line)."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=repr)
    return text if len(text) <= limit else text[:limit] + "..."


class RangePartition(InputPartition):
    """One task's rows: a SELECT over one slice of the ID space."""

    def __init__(self, query: str) -> None:
        super().__init__(query)
        self.query = query


# Catalog connections (psycopg) kept per process and DSN where Spark plans a read or
# asks for offsets: its planning workers are reused, and each read would otherwise
# connect two or three times. A kept one the server closed raises, and `Kept` tries
# once more on a new one. Row reads keep theirs only while their socket shows it whole
# (`read_connections`).
_KEPT: dict[str, Any] = {}


class Kept:
    """An `Ask` on the catalog connection this process keeps for `dsn`."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def __call__(self, work: Callable[[Any], T], /) -> T:
        """`work(conn)` on the kept connection; once more on a new one when it fails
        (the kept one may have broken since; a real error fails again)."""
        for attempt in (1, 2):
            conn = _KEPT.get(self.dsn)
            if conn is None:
                conn = _KEPT[self.dsn] = catalog.connect(self.dsn)
            try:
                return work(conn)
            except ConfigError:
                raise  # a verdict on the options, not a broken connection
            except Exception:
                self.forget()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def forget(self) -> None:
        conn = _KEPT.pop(self.dsn, None)
        if conn is not None:
            with contextlib.suppress(Exception):  # broken already: a new one replaces it
                conn.close()


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
