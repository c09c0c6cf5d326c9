"""Helpers that set up stream tables and rows the way the acceptance scenarios describe."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from psycopg import sql

from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec, Transaction

# Scenario tests pass this so no background refresh changes positions mid-assertion.
QUIET = 3600.0


async def create_table(db: Database, name: str = "events") -> None:
    async with db.connection() as conn:
        await conn.execute(
            sql.SQL(
                "CREATE TABLE {t} (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
                " payload TEXT); CREATE INDEX ON {t} (instance_name, stream_id)"
            ).format(t=sql.Identifier(name))
        )


def spec_for(
    writers: list[str],
    tables: tuple[str, ...] = ("events",),
    backwards: bool = False,
    name: str = "events",
) -> StreamSpec:
    return StreamSpec(
        name=name,
        sequence=f"{name}_seq",
        tables=[TableSpec(t) for t in tables],
        writers=writers,
        backwards=backwards,
    )


async def create_generator(
    db: Database, writers: list[str], instance: str, **kwargs: object
) -> MultiWriterIdGenerator:
    tables = kwargs.pop("tables", ("events",))
    backwards = bool(kwargs.pop("backwards", False))
    kwargs.setdefault("position_flush_interval", QUIET)
    return await MultiWriterIdGenerator.create(
        db,
        spec_for(writers, tables, backwards),  # type: ignore[arg-type]
        instance,
        **kwargs,  # type: ignore[arg-type]
    )


async def insert_rows(
    db: Database,
    instance: str,
    count: int,
    *,
    table: str = "events",
    stream: str = "events",
    update_positions: bool = True,
) -> list[int]:
    """Rows written the way a plain writer would: IDs from the stream's sequence (created
    by hand if missing, so the first ID is 1), then the writer's position row."""
    async with db.connection() as conn:
        await conn.execute(
            sql.SQL("CREATE SEQUENCE IF NOT EXISTS {}").format(sql.Identifier(f"{stream}_seq"))
        )
        ids = []
        for _ in range(count):
            cur = await conn.execute(
                sql.SQL(
                    "INSERT INTO {t} (stream_id, instance_name) VALUES (nextval(%s), %s)"
                    " RETURNING stream_id"
                ).format(t=sql.Identifier(table)),
                (f"{stream}_seq", instance),
            )
            row = await cur.fetchone()
            assert row is not None
            ids.append(int(row[0]))
        if update_positions and ids:
            await upsert_position(db, instance, ids[-1], stream=stream)
    return ids


async def insert_row_with_id(
    db: Database,
    instance: str,
    stream_id: int,
    *,
    table: str = "events",
    stream: str = "events",
) -> None:
    """One row with an explicit ID; the sequence is moved up to it and the position set."""
    async with db.connection() as conn:
        await conn.execute(
            sql.SQL("CREATE SEQUENCE IF NOT EXISTS {}").format(sql.Identifier(f"{stream}_seq"))
        )
        await conn.execute(
            sql.SQL("INSERT INTO {t} (stream_id, instance_name) VALUES (%s, %s)").format(
                t=sql.Identifier(table)
            ),
            (stream_id, instance),
        )
        await conn.execute(
            "SELECT setval(%s, GREATEST(%s, (SELECT last_value FROM " + f'"{stream}_seq"' + ")))",
            (f"{stream}_seq", stream_id),
        )
    await upsert_position(db, instance, stream_id, stream=stream)


async def upsert_position(
    db: Database, instance: str, position: int, *, stream: str = "events"
) -> None:
    async with db.connection() as conn:
        await conn.execute(
            "INSERT INTO stream_positions (stream_name, instance_name, stream_id)"
            " VALUES (%s, %s, %s) ON CONFLICT (stream_name, instance_name)"
            " DO UPDATE SET stream_id = EXCLUDED.stream_id",
            (stream, instance, position),
        )


async def stored_positions(db: Database, stream: str = "events") -> dict[str, int]:
    async with db.connection() as conn:
        cur = await conn.execute(
            "SELECT instance_name, stream_id FROM stream_positions WHERE stream_name = %s",
            (stream,),
        )
        return {name: int(value) for name, value in await cur.fetchall()}


@asynccontextmanager
async def write_in_txn(
    db: Database, gen: MultiWriterIdGenerator, outcome: list[str] | None = None
) -> AsyncIterator[Transaction]:
    """A transaction holding one row written with an ID from `get_next_txn`; `outcome`
    gets "committed" or "rolled back" from the transaction's callbacks."""
    async with db.transaction() as txn:
        if outcome is not None:
            txn.call_after(lambda: outcome.append("committed"))
            txn.call_on_exception(lambda: outcome.append("rolled back"))
        stream_id = await gen.get_next_txn(txn)
        await txn.execute(
            "INSERT INTO events (stream_id, instance_name) VALUES (%s, %s)",
            (stream_id, gen.instance_name),
        )
        yield txn
