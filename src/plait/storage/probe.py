"""The first connection of a pool: a bad DSN, an old server or a pooler plait cannot work
behind becomes one clear error before anything else runs."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import AsyncConnection

from plait.core.redact import redact
from plait.errors import (
    DatabaseUnavailableError,
)
from plait.storage.server_errors import (
    cannot_connect,
    check_dsn,
    invalid_dsn,
    may_come_up,
    reason_of,
)

logger = logging.getLogger(__name__)

MIN_SERVER_VERSION = 140000


async def probe(dsn: str, client: Mapping[str, Any]) -> bool:
    """Connect once to turn a bad DSN, an old server or a pooler plait cannot work
    behind into one clear error. Returns whether a (session) pooler is in between."""
    check_dsn(dsn)
    try:
        conn = await AsyncConnection.connect(
            dsn, **{**client, "connect_timeout": 10, "autocommit": True}
        )
    except psycopg.ProgrammingError as err:
        raise invalid_dsn(dsn, err) from None
    except psycopg.OperationalError as err:
        if may_come_up(err):
            raise  # `connect` tries again while it may wait, then says so
        raise cannot_connect(dsn, reason_of(err)) from None
    try:
        version = conn.info.server_version
        if version < MIN_SERVER_VERSION:
            raise DatabaseUnavailableError(
                f"PostgreSQL {version // 10000} at {redact(dsn)} is too old: plait needs 14 "
                "or newer"
            )
        return await _refuse_pooling_per_transaction(conn, dsn, client)
    finally:
        await conn.close()


async def _backend_pid(conn: AsyncConnection[Any]) -> int:
    row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
    assert row is not None
    return int(row[0])


async def _refuse_pooling_per_transaction(
    conn: AsyncConnection[Any], dsn: str, client: Mapping[str, Any]
) -> bool:
    """Whether a connection pooler sits between plait and the server; refuse one that
    lends server processes per transaction or per statement (PgBouncer's
    `pool_mode = transaction` or `statement`).

    plait fences a dead writer by proving that no server process carries its run's name
    (`incarnation.py`): that holds only if each of its connections keeps one server
    process, named after it, for the connection's life. Behind such a pooler an idle
    writer holds no process at all, its name lingers on processes now serving others,
    and settings, advisory locks and prepared statements land on whichever process
    serves the next transaction: the proof would fence live writers.

    A direct connection is told the real process id at login; a pooler makes up its
    own, so one round trip (`pg_backend_pid()`) tells them apart. Only then, a second
    client asks once and this connection twice more: under session pooling this one
    keeps its process and the other never gets it; lending per transaction, PgBouncer
    hands out its idle processes last-used first (the other client gets this one's) or,
    with `server_round_robin`, in turn (this connection moves on). Other clients busy on
    the same pool at that moment may hide a lending pooler (it is then not refused);
    a session pooler is never refused. A pooler that passes the server's own process id
    on at login is taken for a direct connection."""
    first = await _backend_pid(conn)
    if first == conn.info.backend_pid:
        return False
    other = await AsyncConnection.connect(
        dsn, **{**client, "connect_timeout": 10, "autocommit": True}
    )
    try:
        lent = await _backend_pid(other)
    finally:
        await other.close()
    if lent == first:
        seen = f"server process {first} served two client connections"
    else:
        later = [await _backend_pid(conn) for _ in range(2)]
        moved = next((pid for pid in later if pid != first), None)
        if moved is None:
            return True  # kept its process: session pooling
        seen = f"one client connection was served by server processes {first} and {moved}"
    raise DatabaseUnavailableError(
        f"PostgreSQL at {redact(dsn)} is reached through a connection pooler that lends "
        f"server connections per transaction or per statement ({seen}): plait needs "
        "session pooling (PgBouncer's pool_mode = session) or a direct connection, because "
        "it fences a dead writer by proving that none of its server processes is alive, "
        "and keeps settings and locks on its connections"
    )
