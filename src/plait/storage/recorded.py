"""How the database records a stream, read by the async store and its synchronous
twin alike: its spec's row in `plait_streams` and its sequence's head. The one place
for that SQL and for turning its rows into plait's values."""

from __future__ import annotations

import json
from typing import Any

from psycopg import sql

from plait.core.spec import StreamSpec

# The `plait_streams` columns a spec is made of, in `spec_from_row`'s order.
SPEC_COLUMNS = ("stream_name", "sequence_name", "backwards", "writers", "tables")


def ident(name: str) -> sql.Identifier:
    """A table or sequence name, schema-qualified or not, as an SQL identifier."""
    return sql.Identifier(*name.split("."))


def spec_columns(alias: str | None = None) -> sql.Composed:
    """SPEC_COLUMNS as a select list (of table `alias`, when given)."""
    return sql.SQL(", ").join(
        sql.Identifier(alias, c) if alias else sql.Identifier(c) for c in SPEC_COLUMNS
    )


def spec_from_row(row: tuple[Any, ...]) -> StreamSpec:
    """The spec of a `plait_streams` row read as SPEC_COLUMNS (its first five)."""
    name, sequence, backwards, writers, tables = row[:5]
    return StreamSpec.from_json(
        {
            "name": name,
            "sequence": sequence,
            "backwards": backwards,
            "writers": writers,
            "tables": tables,
        }
    )


def head_query(sequence: str) -> sql.Composed:
    """The row `head_of` reads: the sequence's (last_value, is_called)."""
    return sql.SQL("SELECT last_value, is_called FROM {}").format(ident(sequence))


def head_of(row: tuple[Any, ...]) -> int:
    """The largest ID handed out, from a sequence's (last_value, is_called)."""
    last, called = row
    return int(last) if called else int(last) - 1


def record_spec_statement(spec: StreamSpec) -> tuple[str, tuple[Any, ...]]:
    """The statement (and its parameters) that records `spec` in `plait_streams`, so
    database-only readers (Spark, `plait tail`) find the stream by name; it changes the
    row only when the spec changed."""
    as_json = spec.to_json()
    return (
        "INSERT INTO plait_streams (stream_name, sequence_name, backwards, writers, tables)"
        " VALUES (%s, %s, %s, %s::jsonb, %s::jsonb)"
        " ON CONFLICT (stream_name) DO UPDATE SET sequence_name = EXCLUDED.sequence_name,"
        " backwards = EXCLUDED.backwards, writers = EXCLUDED.writers,"
        " tables = EXCLUDED.tables, updated_at = now()"
        " WHERE (plait_streams.sequence_name, plait_streams.backwards,"
        " plait_streams.writers, plait_streams.tables) IS DISTINCT FROM"
        " (EXCLUDED.sequence_name, EXCLUDED.backwards, EXCLUDED.writers, EXCLUDED.tables)",
        (
            spec.name,
            spec.sequence,
            spec.backwards,
            json.dumps(as_json["writers"]),
            json.dumps(as_json["tables"]),
        ),
    )
