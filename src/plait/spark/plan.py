"""What every reader of a plait source needs, resolved on the driver once (`Plan`): the
stream's spec, its table and columns, how offsets and tokens are checked, and the
tasks' queries."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pyspark.sql.types import StringType, StructField, StructType, TimestampType

from plait.core import offsets
from plait.core.spec import StreamSpec, TableSpec
from plait.core.tokens import StreamToken
from plait.errors import ConfigError, TokenParseError
from plait.spark.kept import Kept
from plait.spark.options import METADATA, Options
from plait.spark.schema import text_columns
from plait.spark.task_reads import RangePartition
from plait.storage import catalog
from plait.storage.range_sql import slice_query

T = TypeVar("T")


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
        return slice_query(
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
