"""Where every stream and writer stands (`plait status`): from the database, plus what
the instances' `/metrics` say when their addresses are known.

`assess` is pure (what one query returned in, verdicts out), so the rules are tested
without a server; `read` is that query. A stream is *stalled* when the writer holding
its persisted-up-to position has not moved its row for `stall_after` seconds while
another writer is ahead: every linear reader then waits on that writer. An idle live
writer is never stalled: it moves its row up to the others' positions every second.

Only a writer itself knows how long its oldest unfinished ID has waited (the database
has no record of IDs taken and not yet committed), so that age comes from its
`plait_stream_oldest_unfinished_age_seconds` gauge: `scrape` reads it.
"""

from __future__ import annotations

import http.client
import json
import math
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import psycopg
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from plait.core.offsets import WriterRange
from plait.core.spec import StreamSpec
from plait.errors import SchemaError
from plait.replication.metrics import OLDEST_UNFINISHED_AGE
from plait.spark.catalog import range_condition
from plait.storage.stream_store import head_of, ident

DEFAULT_STALL_AFTER = 30.0
# Largest /metrics answer read from an instance; a real one is a few hundred kilobytes.
MAX_METRICS_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class WriterRow:
    """A writer's row in `stream_positions`: its position (internal, always-growing
    IDs) and how many seconds ago the row last moved."""

    writer: str
    position: int
    age: float


@dataclass(frozen=True, slots=True)
class StreamRows:
    """One stream as the database records it."""

    name: str
    writers: tuple[str, ...]  # configured writers; empty: any instance writes
    head: int | None  # the largest ID its sequence handed out
    rows: tuple[WriterRow, ...]
    spec: StreamSpec | None = None  # as recorded in plait_streams


@dataclass(frozen=True, slots=True)
class WriterStatus:
    writer: str
    position: int | None  # None: configured, no row yet (never wrote)
    age: float | None
    behind: int  # how far below the stream's furthest writer
    holding: bool  # holds the stream's persisted-up-to position
    # Seconds its oldest unfinished ID has waited (0: none pending); None: unknown.
    pending_age: float | None = None


@dataclass(frozen=True, slots=True)
class StreamStatus:
    name: str
    head: int | None
    persisted_up_to: int | None  # every ID at or below it is committed or abandoned
    gap: int  # furthest writer's position minus persisted-up-to
    writers: tuple[WriterStatus, ...]
    stalled_by: str | None

    @property
    def stalled(self) -> bool:
        return self.stalled_by is not None


def assess(
    stream: StreamRows,
    stall_after: float = DEFAULT_STALL_AFTER,
    pending: Mapping[tuple[str, str], float] | None = None,
) -> StreamStatus:
    """The verdicts on one stream; `pending` holds the ages of the writers' oldest
    unfinished IDs, by (stream, writer), where known (`scrape`)."""
    pending = pending or {}
    rows = {r.writer: r for r in stream.rows if not stream.writers or r.writer in stream.writers}

    def age_of(writer: str) -> float | None:
        return pending.get((stream.name, writer))

    if not rows:
        writers = tuple(WriterStatus(w, None, None, 0, False, age_of(w)) for w in stream.writers)
        return StreamStatus(stream.name, stream.head, None, 0, writers, None)
    low = min(r.position for r in rows.values())
    high = max(r.position for r in rows.values())
    writers = tuple(
        WriterStatus(w, None, None, 0, False, age_of(w))
        if (row := rows.get(w)) is None
        else WriterStatus(
            w, row.position, row.age, high - row.position, row.position == low < high, age_of(w)
        )
        for w in list(stream.writers) or sorted(rows)
    )
    stuck = [w for w in writers if w.holding and w.age is not None and w.age > stall_after]
    stalled_by = max(stuck, key=lambda w: w.age or 0.0).writer if stuck else None
    return StreamStatus(stream.name, stream.head, low, high - low, writers, stalled_by)


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


def read(conn: psycopg.Connection[Any]) -> list[StreamRows]:
    """Every recorded stream with its writers' rows (one query, then one per sequence)."""
    found = conn.execute(
        "SELECT s.stream_name, s.sequence_name, s.backwards, s.writers, s.tables,"
        " p.instance_name, p.stream_id, extract(epoch FROM now() - p.updated_at)::float8"
        " FROM plait_streams s LEFT JOIN stream_positions p ON p.stream_name = s.stream_name"
        " ORDER BY s.stream_name, p.instance_name"
    ).fetchall()
    return list(_streams(conn, found))


def _streams(
    conn: psycopg.Connection[Any], found: Sequence[tuple[Any, ...]]
) -> Iterable[StreamRows]:
    by_stream: dict[str, list[tuple[Any, ...]]] = {}
    for row in found:
        by_stream.setdefault(row[0], []).append(row)
    for name, rows in by_stream.items():
        _, sequence, backwards, writers, tables, *_ = rows[0]
        sign = -1 if backwards else 1
        head_row = conn.execute(
            sql.SQL("SELECT last_value, is_called FROM {}").format(ident(sequence))
        ).fetchone()
        head = None if head_row is None else head_of(head_row)
        yield StreamRows(
            name,
            tuple(writers or ()),
            head,
            tuple(
                WriterRow(writer, sign * int(position), float(age))
                for *_, writer, position, age in rows
                if writer is not None
            ),
            StreamSpec.from_json(
                {
                    "name": name,
                    "sequence": sequence,
                    "backwards": backwards,
                    "writers": writers,
                    "tables": tables,
                }
            ),
        )


def positions(found: Sequence[StreamStatus]) -> dict[tuple[str, str], int]:
    """Each writer's position, by (stream, writer), where it has one."""
    return {
        (s.name, w.writer): w.position for s in found for w in s.writers if w.position is not None
    }


def rates(
    before: Sequence[StreamStatus], after: Sequence[StreamStatus], seconds: float
) -> dict[tuple[str, str], float]:
    """How many IDs a second each writer's position moved between two readings."""
    if seconds <= 0:
        return {}
    earlier = positions(before)
    return {
        (s.name, w.writer): (w.position - old) / seconds
        for s in after
        for w in s.writers
        if w.position is not None and (old := earlier.get((s.name, w.writer))) is not None
    }


def rows_written(
    conn: psycopg.Connection[Any],
    streams: Sequence[StreamRows],
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


def pending_ages(metrics_text: str) -> dict[tuple[str, str], float]:
    """The oldest-unfinished-ID ages in one instance's `/metrics` text, by (stream,
    writer); `ValueError` when the text is not the Prometheus text format. An age that
    is not a finite number of seconds (NaN, -3) counts as unknown."""
    return {
        (sample.labels["stream"], sample.labels["writer"]): float(sample.value)
        for family in text_string_to_metric_families(metrics_text)
        if family.name == OLDEST_UNFINISHED_AGE
        for sample in family.samples
        if "stream" in sample.labels and "writer" in sample.labels and _seconds(sample.value)
    }


def _seconds(value: float) -> bool:
    """Whether a sample is a finite, non-negative number of seconds (the parser gives
    an int too large for a float as an int, which `math.isfinite` cannot take)."""
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:
        return False


def scrape(
    instances: Mapping[str, str], timeout: float = 2.0
) -> tuple[dict[tuple[str, str], float], dict[str, str]]:
    """Read every instance's `/metrics` at once (instance name -> base URL of its
    internal HTTP API). Returns the ages found and, per instance that did not answer
    with metrics, why."""

    def one(base: str) -> dict[tuple[str, str], float]:
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"{base!r} is not an http(s) URL")
        url = base.rstrip("/") + "/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read(MAX_METRICS_BYTES + 1)
        if len(body) > MAX_METRICS_BYTES:
            raise ValueError(f"its /metrics is over {MAX_METRICS_BYTES} bytes")
        return pending_ages(body.decode("utf-8", "replace"))

    ages: dict[tuple[str, str], float] = {}
    failed: dict[str, str] = {}
    if not instances:
        return ages, failed
    with ThreadPoolExecutor(max_workers=min(16, len(instances))) as pool:
        futures = {name: pool.submit(one, base) for name, base in instances.items()}
        for name, future in futures.items():
            try:
                ages.update(future.result())
            # HTTPException: whatever answered is not an HTTP server (a bad status
            # line, a body cut short, too many headers).
            except (OSError, ValueError, http.client.HTTPException) as err:
                why = str(getattr(err, "reason", None) or err) or type(err).__name__
                failed[name] = why[:200]
    return ages, failed


def to_json(stream: StreamStatus) -> str:
    return json.dumps({**asdict(stream), "stalled": stream.stalled}, sort_keys=True)
