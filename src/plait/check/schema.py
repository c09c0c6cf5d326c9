"""The checker's own SQL: a run's schema and tables, what the database holds at the end
(the truth every reader is judged against), and a writer's connections to terminate."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import psycopg
from psycopg import sql

from plait.caches.invalidations import CACHES_STREAM
from plait.check.plan import KV_CHANGED, KV_KEYS, Plan
from plait.storage.cache_rows import CACHES_TABLE
from plait.storage.database import Database
from plait.storage.incarnation import name_prefix
from plait.storage.search_path import in_schema


async def create_schema(server_dsn: str, schema: str) -> tuple[str, tuple[str, int]]:
    """A new, empty `schema` on the server: the DSN that works in it, and where the
    server really is (host, port), for proxies to point at."""
    async with await psycopg.AsyncConnection.connect(server_dsn, autocommit=True) as c:
        await c.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        return in_schema(server_dsn, schema), (c.info.hostaddr or c.info.host, c.info.port)


async def drop_schema(server_dsn: str, schema: str) -> None:
    async with await psycopg.AsyncConnection.connect(server_dsn, autocommit=True) as c:
        await c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def create_tables(plan: Plan) -> None:
    """plait's tables, the plan's stream tables and the cache worker's `check_kv`, in
    the plan's database (its DSN names the run's schema)."""
    db = await Database.connect(plan.dsn, max_size=2)
    try:
        await db.migrate()
        async with db.transaction() as txn:
            for s in plan.stream_names:
                await txn.execute(
                    f"CREATE TABLE {plan.table(s)} (stream_id bigint NOT NULL,"
                    " instance_name text NOT NULL, payload text NOT NULL)"
                )
                await txn.execute(f"CREATE INDEX ON {plan.table(s)} (instance_name, stream_id)")
                await txn.execute(f"CREATE INDEX ON {plan.table(s)} (stream_id)")
            await txn.execute(
                "CREATE TABLE check_kv (s int, k int, version bigint NOT NULL DEFAULT 0,"
                " PRIMARY KEY (s, k))"
            )
            await txn.execute(
                "INSERT INTO check_kv (s, k) SELECT s, k FROM generate_series(0, %s) s,"
                " generate_series(0, %s) k",
                (plan.streams - 1, KV_KEYS - 1),
            )
    finally:
        await db.close()


async def truth(
    plan: Plan,
) -> tuple[dict[str, dict[int, str]], dict[str, dict[int, str]], dict[str, Any]]:
    """What the database holds: committed IDs and writers, per stream; the
    invalidations the worker must get; the targets every reader must reach."""
    rows_of: dict[str, dict[int, str]] = {}
    kv: dict[str, dict[int, str]] = defaultdict(dict)
    async with await psycopg.AsyncConnection.connect(plan.dsn, autocommit=True) as conn:
        for s in plan.stream_names:
            cur = await conn.execute(f"SELECT stream_id, instance_name FROM {plan.table(s)}")
            rows_of[s] = {int(i): str(w) for i, w in await cur.fetchall()}
        cur = await conn.execute(
            f"SELECT keys FROM {CACHES_TABLE} WHERE cache_name = %s", (KV_CHANGED,)
        )
        for (keys,) in await cur.fetchall():
            kv[f"kv.s{keys[0]}"][int(keys[1])] = "*"
        caches = await last_cache_rows(conn)
    writers: dict[str, dict[str, int]] = {}
    for s, rows in rows_of.items():
        per_writer: dict[str, int] = {}
        for i, w in rows.items():
            per_writer[w] = max(per_writer.get(w, 0), i)
        writers[s] = per_writer
    targets = {
        "writers": writers,
        "linear": {s: {"*": max(rows, default=0)} for s, rows in rows_of.items()},
        "caches": {CACHES_STREAM: caches},
    }
    return rows_of, dict(kv), targets


async def last_cache_rows(conn: psycopg.AsyncConnection[Any]) -> dict[str, int]:
    """Each writer's last row of the caches stream."""
    cur = await conn.execute(f"SELECT instance_name, max(stream_id) FROM {CACHES_TABLE} GROUP BY 1")
    return {str(w): int(m) for w, m in await cur.fetchall()}


async def terminate_backend(dsn: str, writer: str, rng: random.Random) -> bool:
    """Terminate one of `writer`'s database connections: those named after an epoch it
    registered in this run's schema (`plait#<epoch> <name>`). Not every `w0` on the
    server: another run's writers of the same names are not this run's to break (two
    checks on one server crashed each other's writers as they started). False when it
    has none."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        cur = await c.execute(
            "SELECT DISTINCT epoch FROM stream_positions"
            " WHERE instance_name = %s AND epoch IS NOT NULL",
            (writer,),
        )
        prefixes = [name_prefix(int(epoch)) for (epoch,) in await cur.fetchall()]
        cur = await c.execute(
            "SELECT pid FROM pg_stat_activity WHERE EXISTS"
            " (SELECT 1 FROM unnest(%s::text[]) AS p WHERE starts_with(application_name, p))",
            (prefixes,),
        )
        pids = [row[0] for row in await cur.fetchall()]
        if not pids:
            return False
        await c.execute("SELECT pg_terminate_backend(%s)", (rng.choice(pids),))
    return True
