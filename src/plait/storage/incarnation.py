"""Writer incarnations: how another instance proves a writer is gone (issue: fencing).

Each run of an instance picks an epoch, names every database connection after it
(`application_name` "plait#<epoch> <instance>") and registers it in its position rows
before its first allocation. A fence then needs no timeout to be safe: once no server
process carries that name, PostgreSQL has committed or rolled back everything the run
did, and a fenced epoch may open no new connection (`refuse_if_fenced`), so nothing it
still holds in memory can commit afterwards.

A later run of the same instance takes over the same way: it registers its epoch only
once no server process carries the previous run's (`WriterRows.register`), and the
previous run, should it still live and connect again, finds itself superseded and may
write nothing more. So a starting writer may take every row of its instance as final.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import psycopg

from plait.errors import FencedError, SupersededError

PREFIX = "plait#"


@dataclass(frozen=True, slots=True)
class Incarnation:
    """One run of one instance."""

    instance: str
    epoch: int

    @classmethod
    def new(cls, instance: str) -> Incarnation:
        """A fresh epoch: microseconds since 1970 (later runs get larger ones) with three
        random digits, so two instances starting in the same microsecond differ too."""
        return cls(instance, time.time_ns() // 1000 * 1000 + secrets.randbelow(1000))

    @property
    def application_name(self) -> str:
        # The server keeps 63 bytes: the epoch comes first so it always survives.
        return f"{name_prefix(self.epoch)}{self.instance}".encode()[:63].decode("utf-8", "ignore")


def name_prefix(epoch: int) -> str:
    """What every connection of that epoch's `application_name` starts with."""
    return f"{PREFIX}{epoch} "


async def name_connection(conn: psycopg.AsyncConnection[Any], incarnation: Incarnation) -> None:
    """Give `conn` the incarnation's `application_name` (what a fence counts)."""
    await conn.execute(
        "SELECT set_config('application_name', %s, false)", (incarnation.application_name,)
    )


async def renew_incarnation(
    conn: psycopg.AsyncConnection[Any], old: Incarnation, new: Incarnation
) -> None:
    """Make `conn` the new incarnation's: its name, and every position row the fenced
    `old` one had, moved to `new`'s epoch and no longer fenced (positions stay where
    the fence left them: forwards only). Under the rows' locks, so a fence in progress
    is waited out, and one that comes later finds this connection alive. One
    transaction: both happen, or neither."""
    async with conn.transaction():
        await name_connection(conn, new)
        await conn.execute(
            "UPDATE stream_positions SET epoch = %s, fenced_at = NULL, updated_at = now()"
            " WHERE epoch = %s",
            (new.epoch, old.epoch),
        )


async def refuse_if_fenced(
    conn: psycopg.AsyncConnection[Any],
    incarnation: Incarnation,
    registered: Collection[str] = (),
) -> None:
    """Run on every new (autocommit) connection of a writer: raise `FencedError` if its
    epoch was fenced, `SupersededError` if a later run of the instance registered on
    one of the streams this run `registered` on. The row lock (KEY SHARE) waits out a
    fence or a registration in progress, which holds the row FOR UPDATE from before it
    looks for live connections: a connection either is seen by it (which then gives
    up, or waits) or sees it."""
    query = (
        "SELECT stream_name, fenced_at, epoch IS DISTINCT FROM %(epoch)s FROM stream_positions"
        " WHERE epoch = %(epoch)s"
        " OR (instance_name = %(instance)s AND stream_name = ANY(%(registered)s))"
    )
    names = {
        "epoch": incarnation.epoch,
        "instance": incarnation.instance,
        "registered": sorted(registered),
    }
    try:
        try:
            cursor = await conn.execute(query + " FOR KEY SHARE", names)
        except psycopg.errors.InsufficientPrivilege:
            # A role that may not lock the rows may not write them either: it is no
            # writer, has no IDs to protect, and only needs to know.
            cursor = await conn.execute(query, names)
        rows = await cursor.fetchall()
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn):
        rows = []  # no plait schema yet (the first connection migrates it)
    superseded = sorted(row[0] for row in rows if row[2])
    if superseded:
        raise SupersededError(
            f"instance {incarnation.instance!r} (epoch {incarnation.epoch}) was superseded on "
            f"{', '.join(superseded)}: a later run of it registered while this one had no "
            "connection (two processes never write under one name: their positions would "
            "cover each other's IDs). This process must not write again: stop it"
        )
    fenced = [row[0] for row in rows if row[1] is not None]
    if fenced:
        raise FencedError(
            f"instance {incarnation.instance!r} (epoch {incarnation.epoch}) was fenced on "
            f"{', '.join(sorted(fenced))}: another instance found none of its connections "
            "alive and moved its position past the IDs it held. This process must not "
            "write again: restart it"
        )
