"""The command line's follow loops (`ops.reconnect`) without a server: a step whose
connection was lost runs again on a new one; one that fails otherwise is not retried;
a server that stays away ends it with plait's error, after the patience."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from plait.errors import DatabaseUnavailableError
from plait.ops.reconnect import Reconnecting


class Conn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False

    def close(self) -> None:
        self.closed = True


def lost() -> psycopg.OperationalError:
    return psycopg.OperationalError("server closed the connection unexpectedly")


def test_a_lost_connection_is_replaced_and_the_step_runs_again() -> None:
    said: list[str] = []
    made = iter([lost(), Conn("second")])

    def connect() -> Any:
        result = next(made)
        if isinstance(result, Exception):
            raise result
        return result

    first = Conn("first")
    link = Reconnecting(first, connect, "host=db port=5433", said.append, sleep=lambda s: None)  # type: ignore[arg-type]
    calls: list[str] = []

    def step(conn: Any) -> str:
        calls.append(conn.name)
        if conn is first:
            raise lost()
        return "rows"

    assert link.run(step) == "rows"
    assert calls == ["first", "second"]
    assert not first.closed  # the caller's
    assert "lost the connection to PostgreSQL at db:5433" in said[0]
    assert "again" in said[1]
    link.close()
    assert link.conn.closed


def test_a_failing_statement_is_not_retried() -> None:
    link = Reconnecting(Conn("c"), lambda: Conn("new"), "", print)  # type: ignore[arg-type, return-value]

    def step(conn: Any) -> None:
        raise psycopg.errors.UndefinedTable("relation does not exist")

    with pytest.raises(psycopg.errors.UndefinedTable):
        link.run(step)


def test_a_server_that_stays_away_ends_it_with_plaits_error() -> None:
    clock = [0.0]

    def connect() -> Any:
        raise psycopg.OperationalError("connection refused")

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    link = Reconnecting(
        Conn("c"),  # type: ignore[arg-type]
        connect,
        "host=db",
        lambda _: None,
        patience=5,
        sleep=sleep,
        now=lambda: clock[0],
    )

    def step(conn: Any) -> None:
        raise lost()

    with pytest.raises(DatabaseUnavailableError, match=r"unreachable for 5 s \(connection refused"):
        link.run(step)
    assert 5 <= clock[0] < 8


def test_a_server_that_refuses_for_good_ends_it_at_once() -> None:
    """A wrong password after the restart is not waited on for the whole patience."""
    slept: list[float] = []

    def connect() -> Any:
        raise psycopg.OperationalError('FATAL:  password authentication failed for user "x"')

    link = Reconnecting(
        Conn("c"),  # type: ignore[arg-type]
        connect,
        "host=db",
        lambda _: None,
        patience=60,
        sleep=slept.append,
    )

    def step(conn: Any) -> None:
        raise lost()

    with pytest.raises(DatabaseUnavailableError, match="refused the connection again"):
        link.run(step)
    assert len(slept) == 1
