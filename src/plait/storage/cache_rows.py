"""The SQL of plait's cache invalidation rows (`cache_invalidations`, migration 2): how a
transaction's invalidations are written, how old ones are deleted in batches (R-CA-4),
and the lock a process starts reading them under. The rules around them live in
`plait.caches`."""

from __future__ import annotations

from plait.storage.transaction import Transaction

CACHES_TABLE = "cache_invalidations"
CACHES_SEQUENCE = "cache_invalidations_seq"

# All invalidation rows of a transaction in one statement; `{id}` takes one ID per row
# (`MultiWriterIdGenerator.insert_with_commit`), the parameters are the instance's name
# and the rows as a JSON array of [cache name, keys or null].
INSERT_ROWS = (
    f"INSERT INTO {CACHES_TABLE} (stream_id, instance_name, cache_name, keys, invalidation_ts)"
    " SELECT {id}, %s, r->>0, NULLIF(r->1, 'null'::jsonb), statement_timestamp()"
    " FROM jsonb_array_elements(%s::jsonb) AS r RETURNING *"
)

_CLEANUP_LOCK = 0x706C616974_02  # "plait", 2: one cleaner at a time

# The oldest `batch` rows by ID (the primary key: reads just them), of which those
# older than the retention go. IDs grow with time, so old rows are at the head.
_DELETE_BATCH = f"""
WITH head AS (
    SELECT stream_id, invalidation_ts FROM {CACHES_TABLE} ORDER BY stream_id LIMIT %(batch)s
), gone AS (
    DELETE FROM {CACHES_TABLE} WHERE stream_id IN (
        SELECT stream_id FROM head
        WHERE invalidation_ts < statement_timestamp() - make_interval(secs => %(retention)s)
    ) RETURNING 1
)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM head)
"""


async def delete_old_rows(txn: Transaction, batch: int, retention: float) -> tuple[int, int] | None:
    """Among the oldest `batch` rows, delete those older than `retention` seconds:
    (rows deleted, rows looked at). None when another process is cleaning (a
    transaction-scoped advisory lock: one cleaner at a time)."""
    cursor = await txn.execute("SELECT pg_try_advisory_xact_lock(%s)", (_CLEANUP_LOCK,))
    locked = await cursor.fetchone()
    if not locked or not locked[0]:
        return None
    cursor = await txn.execute(_DELETE_BATCH, {"batch": batch, "retention": retention})
    row = await cursor.fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def hold_back_writers(txn: Transaction, lock_timeout: str) -> None:
    """Wait until no invalidation row is on its way to COMMIT, and keep new ones out
    for the rest of `txn` (a SHARE lock on the table); `psycopg.errors.LockNotAvailable`
    after `lock_timeout` (a PostgreSQL interval, e.g. "5s")."""
    await txn.execute(f"SET LOCAL lock_timeout = '{lock_timeout}'")
    await txn.execute(f"LOCK TABLE {CACHES_TABLE} IN SHARE MODE")
