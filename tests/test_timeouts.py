"""The settings that bound a partition (`DatabaseTimeouts`), as both ends of a real
connection see them: plait's defaults, what a DSN sets winning, and a configuration
that turns them off."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pace
from plait import Database
from plait.config import InstanceConfig
from plait.errors import ConfigError
from plait.instance import Instance
from plait.storage.timeouts import DatabaseTimeouts, connect_sync, options_set

SERVER = (
    "tcp_keepalives_idle",
    "tcp_keepalives_interval",
    "tcp_keepalives_count",
    "tcp_user_timeout",
    "idle_in_transaction_session_timeout",
)
CLIENT = ("keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count")


async def server_side(db: Database) -> dict[str, str]:
    """The session's settings in their base units (seconds, milliseconds), on a
    connection of `db`'s pool."""
    async with db.connection() as conn:
        cursor = await conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)", (list(SERVER),)
        )
        return dict(await cursor.fetchall())


def client_side(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> dict[str, str]:
    info = {
        o.keyword.decode(): (o.val or b"").decode()
        for o in conn.pgconn.info
        if o.keyword.decode() in (*CLIENT, "tcp_user_timeout")
    }
    return info


async def test_plaits_connections_carry_the_defaults_on_both_ends(dsn: str) -> None:
    db = await Database.connect(dsn, max_size=1)
    try:
        assert await server_side(db) == {
            "tcp_keepalives_idle": "3",
            "tcp_keepalives_interval": "1",
            "tcp_keepalives_count": "3",
            "tcp_user_timeout": "6000",
            "idle_in_transaction_session_timeout": "60000",
        }
        async with db.connection() as conn:
            assert client_side(conn) == {
                "keepalives": "1",
                "keepalives_idle": "3",
                "keepalives_interval": "1",
                "keepalives_count": "3",
                "tcp_user_timeout": "6000",
            }
    finally:
        await db.close()
    assert DatabaseTimeouts().dead_after == 6.0


async def test_what_the_dsn_sets_wins(dsn: str) -> None:
    params = conninfo_to_dict(dsn)
    options = f"{params.get('options', '')} -c idle_in_transaction_session_timeout=5s"
    options += " --tcp-keepalives-count=7"
    ours = make_conninfo(dsn, keepalives_idle="30", options=options)
    db = await Database.connect(ours, max_size=1)
    try:
        server = await server_side(db)
        assert server["idle_in_transaction_session_timeout"] == "5000"
        assert server["tcp_keepalives_count"] == "7"
        assert server["tcp_keepalives_idle"] == "3"  # the DSN set the client's only
        async with db.connection() as conn:
            client = client_side(conn)
            assert client["keepalives_idle"] == "30"
            assert client["keepalives_count"] == "3"
            # The test's own option (its schema) still applies.
            assert (await (await conn.execute("SHOW search_path")).fetchone()) == (
                str(params["options"]).split("search_path=")[1],
            )
    finally:
        await db.close()


async def test_settings_left_unset_stay_as_the_server_has_them(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cursor = await conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)", (list(SERVER),)
        )
        before: dict[str, str] = dict(await cursor.fetchall())
    off = DatabaseTimeouts(
        keepalives=False, tcp_user_timeout=None, idle_in_transaction_session_timeout=None
    )
    db = await Database.connect(dsn, max_size=1, timeouts=off)
    try:
        assert await server_side(db) == before
        async with db.connection() as conn:
            assert client_side(conn)["keepalives"] == "0"
            assert client_side(conn)["tcp_user_timeout"] in ("", "0")
    finally:
        await db.close()


async def test_an_idle_transaction_past_the_timeout_ends_on_the_server(dsn: str) -> None:
    """What the setting does to a transaction that waits too long between statements:
    its next statement fails, nothing of it is committed."""
    db = await Database.connect(
        dsn, max_size=1, timeouts=DatabaseTimeouts(idle_in_transaction_session_timeout=0.2)
    )
    try:
        with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
            await stall(db, dsn)
        assert (await server_side(db))["idle_in_transaction_session_timeout"] == "200"
    finally:
        await db.close()


async def stall(db: Database, dsn: str) -> None:
    async with db.transaction() as txn:
        await txn.execute("SELECT 1")
        conn = await txn.connection()
        await until_gone(dsn, conn.info.backend_pid, within=30.0)
        await txn.execute("SELECT 1")


async def until_gone(dsn: str, pid: int, within: float) -> None:
    """Until server process `pid` ended, for `within` seconds at this machine's pace."""
    async with (
        pace.within(within, f"server process {pid} to end"),
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as watcher,
    ):
        query = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
        while (await (await watcher.execute(query, (pid,))).fetchone()) != (0,):  # noqa: ASYNC110
            await asyncio.sleep(0.02)


def test_the_sync_tools_connect_with_the_client_settings(server_dsn: str) -> None:
    with connect_sync(server_dsn, autocommit=True) as conn:
        assert client_side(conn)["keepalives_idle"] == "3"
        assert client_side(conn)["tcp_user_timeout"] == "6000"
    uri = "postgresql://u@h:5432/db?keepalives_idle=30"
    assert DatabaseTimeouts().client_dsn(uri).startswith(uri + "&keepalives=1&")
    assert conninfo_to_dict(DatabaseTimeouts().client_dsn(uri))["keepalives_idle"] == "30"
    assert DatabaseTimeouts().client_dsn("not a dsn ==") == "not a dsn =="


def test_the_configuration_section() -> None:
    config = InstanceConfig.load(
        {
            "instance_name": "w1",
            "database_timeouts": {
                "keepalives_idle": 10,
                "idle_in_transaction_session_timeout": None,
            },
        }
    )
    assert config.database_timeouts.keepalives_idle == 10
    assert config.database_timeouts.idle_in_transaction_session_timeout is None
    assert config.database_timeouts.keepalives_count == 3
    assert InstanceConfig.load({"instance_name": "w1"}).database_timeouts == DatabaseTimeouts()
    for bad in ({"keepalives_idle": 0}, {"tcp_user_timeout": -1}, {"keepalive": True}):
        with pytest.raises(ConfigError, match=r"database_timeouts\."):
            InstanceConfig.load({"instance_name": "w1", "database_timeouts": bad})


_NAMES = st.from_regex(r"[a-z][a-z_]{0,20}", fullmatch=True)
_VALUES = st.from_regex(r"[A-Za-z0-9_.,]{1,10}", fullmatch=True)


@given(st.lists(st.tuples(_NAMES, _VALUES, st.sampled_from(["-c ", "-c", "--"])), max_size=6))
def test_options_set_reads_every_form_libpq_sends(settings: list[tuple[str, str, str]]) -> None:
    options = " ".join(
        f"{form}{name.replace('_', '-') if form == '--' else name}={value}"
        for name, value, form in settings
    )
    assert options_set(options) == {name for name, _, _ in settings}


async def test_an_instance_connects_with_its_configured_timeouts(dsn: str) -> None:
    instance = Instance(
        {
            "instance_name": "w1",
            "database": dsn,
            "http": {"enabled": False},
            "caches": {"enabled": False},
            "database_timeouts": {"keepalives_idle": 11, "idle_in_transaction_session_timeout": 7},
        }
    )
    await instance.start()
    try:
        server = await server_side(instance.db)
        assert server["tcp_keepalives_idle"] == "11"
        assert server["idle_in_transaction_session_timeout"] == "7000"
    finally:
        await instance.stop()
