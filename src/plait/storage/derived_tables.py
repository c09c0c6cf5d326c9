"""The SQL of `plait derive`'s tables: a table kept from a stream by Spark (the latest
row per key, or counts per key and hour) and the markers of the batches applied to it,
which make a replayed batch change nothing (exactly once)."""

from __future__ import annotations

from typing import Any, Literal

from psycopg import sql

from plait.storage.recorded import ident
from plait.storage.timeouts import connect_sync

# Which batches of which job were applied: (job, batch_id), one row per batch.
MARKERS = "plait_spark_batches"

Kind = Literal["latest", "counts"]


def create(dsn: str, table: str, kind: Kind) -> None:
    """The derived table and the markers' table, unless they exist."""
    name = ident(table)
    if kind == "latest":
        ddl = sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (key TEXT PRIMARY KEY, stream_id BIGINT NOT NULL,"
            " instance_name TEXT NOT NULL, row JSONB NOT NULL)"
        ).format(name)
    else:
        ddl = sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (key TEXT NOT NULL, hour TIMESTAMPTZ NOT NULL,"
            " count BIGINT NOT NULL, PRIMARY KEY (key, hour))"
        ).format(name)
    with connect_sync(dsn, autocommit=True) as conn:
        conn.execute(ddl)
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {MARKERS} (job TEXT NOT NULL,"
            " batch_id BIGINT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now(),"
            " PRIMARY KEY (job, batch_id))"
        )


def apply(
    dsn: str, table: str, kind: Kind, job: str, rows: list[tuple[Any, ...]], batch_id: int
) -> bool:
    """Apply one batch's rows with its marker, in one transaction: (key, stream_id,
    instance, json) rows for `latest` (a later stream_id wins), (key, hour, count) for
    `counts` (added). False when the marker was there already (a replayed batch)."""
    name = ident(table)
    with connect_sync(dsn) as conn, conn.transaction():
        fresh = conn.execute(
            f"INSERT INTO {MARKERS} (job, batch_id) VALUES (%s, %s)"
            " ON CONFLICT DO NOTHING RETURNING 1",
            (job, batch_id),
        ).fetchone()
        if fresh is None:
            return False
        if not rows:
            return True
        with conn.cursor() as cursor:
            if kind == "latest":
                cursor.executemany(
                    sql.SQL(
                        "INSERT INTO {} (key, stream_id, instance_name, row)"
                        " VALUES (%s, %s, %s, %s::jsonb) ON CONFLICT (key) DO UPDATE SET"
                        " stream_id = EXCLUDED.stream_id,"
                        " instance_name = EXCLUDED.instance_name, row = EXCLUDED.row"
                        " WHERE {}.stream_id < EXCLUDED.stream_id"
                    ).format(name, name),
                    rows,
                )
            else:
                cursor.executemany(
                    sql.SQL(
                        "INSERT INTO {} (key, hour, count) VALUES (%s, %s, %s)"
                        " ON CONFLICT (key, hour) DO UPDATE"
                        " SET count = {}.count + EXCLUDED.count"
                    ).format(name, name),
                    rows,
                )
    return True
