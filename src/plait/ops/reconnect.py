"""A connection for the command line's follow loops (`tail -f`, `status --watch`) that
outlasts a PostgreSQL restart, crash or failover: a step whose connection was lost is
run again on a new one, connecting with backoff for up to the library's patience
(`database_patience`, 60 s; a server that refuses us for good, as `Database.connect`
tells them apart, ends it at once), with one line to stderr when the connection is lost and
one when it is back. Before, the first restart ended the command ("terminating
connection due to administrator command").

Each step reads only (or writes idempotently, as `instance_map`'s ON CONFLICT DO
NOTHING), so running it again is safe. Synchronous, like the commands."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from plait.core.backoff import Backoff
from plait.errors import DatabaseUnavailableError
from plait.storage.database import DEFAULT_RETRY_READS_FOR
from plait.storage.server_errors import connection_lost, may_come_up, server_address

T = TypeVar("T")


class Reconnecting:
    """`run(step)` calls `step(conn)`; a lost connection is replaced (see the module).
    Closing the connections is the caller's: the first one it gave, later ones here."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        connect: Callable[[], psycopg.Connection[Any]],
        dsn: str,
        say: Callable[[str], None],
        *,
        patience: float = DEFAULT_RETRY_READS_FOR,
        sleep: Callable[[float], None] = time.sleep,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect
        self._server = server_address(dsn)
        self._say = say
        self._patience = patience
        self._sleep = sleep
        self._now = now
        self.conn = conn  # the one the command has; `connect` makes the next ones
        self._given = conn

    def run(self, step: Callable[[psycopg.Connection[Any]], T]) -> T:
        try:
            return step(self.conn)
        except psycopg.OperationalError as err:
            if not (connection_lost(err) or self.conn.closed):
                raise
            lost = err
        self._say(
            f"plait: lost the connection to PostgreSQL at {self._server} ({_first_line(lost)});"
            f" reconnecting for up to {self._patience:.0f} s"
        )
        self._reconnect(lost)
        self._say(f"plait: connected to PostgreSQL at {self._server} again")
        return step(self.conn)

    def close(self) -> None:
        """Close the connection made here, if any (the given one is the caller's)."""
        if self.conn is not self._given:
            self.conn.close()

    def _reconnect(self, lost: psycopg.OperationalError) -> None:
        if self.conn is not self._given:
            self.conn.close()
        backoff = Backoff(initial=0.1, cap=2.0)
        deadline = self._now() + self._patience
        last: psycopg.OperationalError = lost
        while self._now() < deadline:
            self._sleep(min(backoff.next_delay(), max(deadline - self._now(), 0.0)))
            try:
                self.conn = self._connect()
                return
            except psycopg.OperationalError as err:
                if not may_come_up(err):  # a wrong password, no such database: for good
                    raise DatabaseUnavailableError(
                        f"PostgreSQL at {self._server} refused the connection again: "
                        f"{_first_line(err)}"
                    ) from err
                last = err
        raise DatabaseUnavailableError(
            f"PostgreSQL at {self._server} has been unreachable for {self._patience:.0f} s "
            f"({_first_line(last)}): check that the server is up and reachable, then run "
            "the command again"
        ) from last


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
