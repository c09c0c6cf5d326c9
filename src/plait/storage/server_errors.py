"""Telling a server that went away (try again) from one that refused plait (say what to
fix), and saying either in the user's terms: where the server is, no secrets."""

from __future__ import annotations

import getpass
import logging
import os
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import PoolTimeout

from plait.core.redact import redact
from plait.errors import (
    DatabaseUnavailableError,
    InvalidDsnError,
)
from plait.storage.timeouts import connect_sync

logger = logging.getLogger(__name__)

# A server that answered a connection attempt with one of these is there but not taking
# connections yet (or any more, or is full): trying again later may succeed. libpq
# gives connection failures no SQLSTATE, only the server's message.
_NOT_ACCEPTING_YET = (
    "starting up",
    "shutting down",
    "in recovery mode",
    "not yet accepting connections",
    "not accepting connections",
    "too many clients",
    "remaining connection slots",
)
# libpq's own refusals (no FATAL from a server): nothing changes them but the
# configuration (a password, certificates, SSL or GSS settings).
_REFUSED_FOR_GOOD = (
    "no password supplied",
    "password authentication failed",
    "SSL error",
    "certificate",
    "server does not support SSL",
    "GSSAPI",
    "invalid connection option",
    "invalid sslmode",
    "invalid port",
)
# SQLSTATEs of a server that ended the session: shut down by an administrator, crashed,
# or not accepting connections yet (starting up, shutting down, recovering).
_SERVER_WENT_AWAY = frozenset({"57P01", "57P02", "57P03"})


def connection_lost(err: psycopg.OperationalError) -> bool:
    """Whether `err` says the connection or the server went away (and a read may be
    tried again on a new connection), not that the statement itself failed."""
    if isinstance(err, PoolTimeout):
        return True  # no connection to be had within the pool's timeout
    sqlstate = err.sqlstate
    # No SQLSTATE: libpq's own errors (the server closed the connection, connection
    # refused, the connection is closed). Class 08: connection exceptions.
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in _SERVER_WENT_AWAY


def may_come_up(err: psycopg.OperationalError) -> bool:
    """Whether a failed connection attempt may succeed later with nothing changed: no
    server answered (refused, timed out, no socket yet, a name not resolved yet), or
    one answered that it is starting, stopping, recovering or full. One that refused
    us for good (a wrong password, user or database name, no pg_hba.conf entry)
    answers FATAL with another reason."""
    if isinstance(err, PoolTimeout):
        return True
    text = str(err)
    if any(phrase in text for phrase in _REFUSED_FOR_GOOD):
        return False
    return "FATAL:" not in text or any(phrase in text for phrase in _NOT_ACCEPTING_YET)


CHECK_DSN = "Check host, port, user, password and database name"


def cannot_connect(
    dsn: str, reason: str, fix: str = f"{CHECK_DSN}, or pass dsn=None to use the embedded server"
) -> DatabaseUnavailableError:
    """No server answered at `dsn`, or it refused the connection: where, why, and `fix`
    (in the Python API's terms; the command line words its own from the fields)."""
    return DatabaseUnavailableError(
        f"could not connect to PostgreSQL at {redact(dsn)}: {reason}. {fix}",
        server=server_address(dsn),
        reason=reason,
    )


def connect_or_say(
    dsn: str, fix: str = f"{CHECK_DSN} of the DSN", **kwargs: Any
) -> psycopg.Connection[Any]:
    """A plain (synchronous) connection (`connect_sync`), or `cannot_connect`'s error
    saying where and why when there is none (not psycopg's, which may quote the DSN)."""
    check_dsn(dsn)
    try:
        return connect_sync(dsn, **kwargs)
    except psycopg.ProgrammingError as err:
        raise invalid_dsn(dsn, err) from None
    except psycopg.Error as err:
        raise cannot_connect(dsn, reason_of(err), fix) from None


def check_dsn(dsn: str) -> None:
    """Raise `InvalidDsnError` for a DSN libpq cannot parse, or whose port is not a
    number (psycopg would look it up as a service name and fail with a resolver's
    riddle, "Servname not supported for ai_socktype")."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as err:
        raise invalid_dsn(dsn, err) from None
    port = str(params.get("port") or "")
    if port and not all(part.strip().isdigit() for part in port.split(",")):
        raise invalid_dsn(dsn, f"the port {port!r} is not a number")


def invalid_dsn(dsn: str, err: psycopg.ProgrammingError | str) -> InvalidDsnError:
    """`dsn` is malformed: which DSN (no secrets) and what is wrong with it."""
    # libpq's message may quote the DSN back, password and all.
    reason = f"invalid DSN {redact(dsn)!r}: {redact(str(err).strip())}"
    return InvalidDsnError(
        f"{reason}. Use a URI such as postgresql://user@host:5432/dbname, or dsn=None "
        "for the embedded server",
        server=server_address(dsn),
        reason=reason,
    )


def reason_of(err: BaseException) -> str:
    """The first line of an error, without secrets: libpq's messages go on with hints
    over lines, and quote some DSNs back."""
    text = str(err).strip()
    if not text:
        return type(err).__name__
    # A name with several addresses: libpq says how each attempt failed, one per line
    # (::1 refused, then 127.0.0.1 refused the password); the last one is the verdict.
    attempts = [line.strip() for line in text.splitlines() if "failed:" in line]
    return redact(attempts[-1] if attempts else text.splitlines()[0])


def server_address(dsn: str) -> str:
    """Where the server is, for log lines and errors: host, port and database, no
    secrets."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return redact(dsn)
    # What the DSN leaves out, libpq takes from PGHOST, PGPORT, PGDATABASE and PGUSER,
    # then from its defaults: the local socket, 5432, the user's own name.
    env = os.environ
    host = (
        params.get("host")
        or params.get("hostaddr")
        or env.get("PGHOST")
        or env.get("PGHOSTADDR")
        or "localhost"
    )
    port = params.get("port") or env.get("PGPORT") or 5432
    user = params.get("user") or env.get("PGUSER") or getpass.getuser()
    dbname = params.get("dbname") or env.get("PGDATABASE") or user
    return f"{host}:{port}/{dbname}"
