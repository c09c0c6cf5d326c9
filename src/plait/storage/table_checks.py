"""The start-up check of a stream's tables: each exists, its ID and writer columns have
usable types, and the (writer, ID) index start-up and per-writer reads rely on is there
(a warning, with the statement that creates it, when not)."""

from __future__ import annotations

import logging

from plait.core.spec import StreamSpec
from plait.errors import SchemaError
from plait.storage.database import Database
from plait.storage.identity import regclass_text
from plait.storage.stream_tables import StreamTable

logger = logging.getLogger("plait.storage.stream_store")  # what operators filter on

_INTEGER_TYPES = {"bigint", "integer", "smallint"}
_TEXT_TYPES = {"text", "character varying", "character", "name"}


async def check_tables(db: Database, spec: StreamSpec, tables: list[StreamTable]) -> bool:
    """Every table of `spec` and its columns exist with a usable type; warn about a
    missing index. One round trip for all tables. Returns whether the sequence exists
    already."""
    async with db.connection() as conn:
        async with conn.pipeline():
            sequence = await conn.execute(
                "SELECT to_regclass(%s) IS NOT NULL", (regclass_text(spec.sequence),)
            )
            found = [
                (
                    table,
                    await conn.execute("SELECT to_regclass(%s)::oid", (regclass_text(table.name),)),
                    await conn.execute(
                        "SELECT attname, attnum, format_type(atttypid, NULL) FROM pg_attribute"
                        " WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped",
                        (regclass_text(table.name),),
                    ),
                    await conn.execute(
                        "SELECT indkey[0], indkey[1] FROM pg_index WHERE indrelid ="
                        " to_regclass(%s) AND indisvalid AND indpred IS NULL",
                        (regclass_text(table.name),),
                    ),
                )
                for table in tables
            ]
        exists = await sequence.fetchone()
        for table, oid, columns, indexes in found:
            row = await oid.fetchone()
            _check_table(
                spec.name,
                table,
                None if row is None else row[0],
                {name: (num, kind) for name, num, kind in await columns.fetchall()},
                {(first, second) for first, second in await indexes.fetchall()},
            )
    return bool(exists and exists[0])


def _check_table(
    stream: str,
    table: StreamTable,
    oid: int | None,
    columns: dict[str, tuple[int, str]],
    indexes: set[tuple[int, int]],
) -> None:
    spec = table.spec
    table.columns = frozenset(columns)
    if oid is None:
        raise SchemaError(
            f"stream {stream!r}: table {spec.name!r} does not exist. Create it "
            f"with a BIGINT {spec.id_column!r} column and a TEXT {spec.instance_column!r} "
            "column, or fix the stream's table name (its `tables` in the configuration "
            "file, its TableSpec in Python)"
        )
    for column, allowed, wanted in (
        (spec.id_column, _INTEGER_TYPES, "BIGINT"),
        (spec.instance_column, _TEXT_TYPES, "TEXT"),
    ):
        if column not in columns:
            raise SchemaError(
                f"stream {stream!r}: table {spec.name!r} has no column {column!r} "
                f"(it has {', '.join(sorted(columns))}). Add a {wanted} column {column!r} "
                "or fix the column name (`id_column`/`instance_column` of the stream's "
                "table in the configuration file, of its TableSpec in Python)"
            )
        if columns[column][1] not in allowed:
            raise SchemaError(
                f"stream {stream!r}: column {spec.name}.{column} is "
                f"{columns[column][1]}, but plait needs {wanted}"
            )
    if columns[spec.id_column][1] != "bigint":
        logger.warning(
            "stream %s: %s.%s is %s; BIGINT is recommended",
            stream,
            spec.name,
            spec.id_column,
            columns[spec.id_column][1],
        )
    table.indexed = (columns[spec.instance_column][0], columns[spec.id_column][0]) in indexes
    table.id_indexed = any(first == columns[spec.id_column][0] for first, _ in indexes)
    if not table.indexed:
        logger.warning(
            "stream %s: table %s has no index on (%s, %s), so start-up and per-writer "
            "reads scan it; create one with: CREATE INDEX CONCURRENTLY ON %s (%s, %s)",
            stream,
            spec.name,
            spec.instance_column,
            spec.id_column,
            spec.name,
            spec.instance_column,
            spec.id_column,
        )
