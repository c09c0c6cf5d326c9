"""What the database records of every stream (`plait status` reads it): each stream's
spec, sequence head and writers' rows in `stream_positions`, and how many rows a
writer persisted between two readings. Synchronous, for the command line."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from plait.core.offsets import WriterRange
from plait.core.spec import StreamSpec
from plait.errors import SchemaError
from plait.storage.range_sql import range_condition
from plait.storage.recorded import head_of, head_query, ident, spec_columns, spec_from_row


@dataclass(frozen=True, slots=True)
class WriterRow:
    """A writer's row in `stream_positions`: its position (internal, always-growing
    IDs) and how many seconds ago the row last moved."""

    writer: str
    position: int
    age: float


@dataclass(frozen=True, slots=True)
class RecordedStream:
    """One stream as the database records it."""

    name: str
    writers: tuple[str, ...]  # configured writers; empty: any instance writes
    head: int | None  # the largest ID its sequence handed out
    rows: tuple[WriterRow, ...]
    spec: StreamSpec | None = None  # as recorded in plait_streams


NEEDS_SCHEMA = 3  # stream_positions.updated_at


def check_schema(conn: psycopg.Connection[Any]) -> None:
    """`SchemaError` unless the database has a plait schema `read` can use (once per
    command: `--watch` reads again and again)."""
    try:
        row = conn.execute("SELECT max(version) FROM plait_schema_version").fetchone()
    except psycopg.errors.UndefinedTable:
        raise SchemaError(
            "this database has no plait schema (no plait_schema_version table in its "
            "search_path): check the DSN's database, and the schema (--schema; `plait "
            "demo` works in plait_demo)"
        ) from None
    version = int(row[0]) if row and row[0] is not None else 0
    if version < NEEDS_SCHEMA:
        raise SchemaError(
            f"this database's plait schema is version {version}; reading its status needs "
            f"{NEEDS_SCHEMA}: run `plait migrate` (or start any plait instance on it)"
        )


def read(conn: psycopg.Connection[Any]) -> list[RecordedStream]:
    """Every recorded stream with its writers' rows (one query, then one per sequence)."""
    found = conn.execute(
        sql.SQL(
            "SELECT {}, p.instance_name, p.stream_id,"
            " extract(epoch FROM now() - p.updated_at)::float8"
            " FROM plait_streams s LEFT JOIN stream_positions p ON p.stream_name = s.stream_name"
            " ORDER BY s.stream_name, p.instance_name"
        ).format(spec_columns("s"))
    ).fetchall()
    return list(_streams(conn, found))


def _streams(
    conn: psycopg.Connection[Any], found: Sequence[tuple[Any, ...]]
) -> Iterable[RecordedStream]:
    by_stream: dict[str, list[tuple[Any, ...]]] = {}
    for row in found:
        by_stream.setdefault(row[0], []).append(row)
    for name, rows in by_stream.items():
        spec = spec_from_row(rows[0])
        head_row = conn.execute(head_query(spec.sequence)).fetchone()
        head = None if head_row is None else head_of(head_row)
        yield RecordedStream(
            name,
            tuple(spec.writers),
            head,
            tuple(
                WriterRow(writer, spec.sign * int(position), float(age))
                for *_, writer, position, age in rows
                if writer is not None
            ),
            spec,
        )


def rows_written(
    conn: psycopg.Connection[Any],
    streams: Sequence[RecordedStream],
    since: Mapping[tuple[str, str], int],
) -> dict[tuple[str, str], int]:
    """How many rows each writer persisted between the position it had in `since` and
    the one in `streams` (both read from the database): one count per table and writer
    that moved, each an index range scan."""
    counts: dict[tuple[str, str], int] = {}
    for stream in streams:
        if stream.spec is None:
            continue
        for row in stream.rows:
            low = since.get((stream.name, row.writer))
            if low is None or row.position <= low:
                continue
            moved = WriterRange(row.writer, low, row.position)
            total = 0
            for table in stream.spec.tables:
                query = sql.SQL("SELECT count(*) FROM {} WHERE {}").format(
                    ident(table.name), range_condition(table, stream.spec.backwards, moved)
                )
                found = conn.execute(query).fetchone()
                total += int(found[0]) if found else 0
            counts[(stream.name, row.writer)] = total
    return counts
