"""How long a silent peer keeps a PostgreSQL connection: the settings that bound a
network partition (issue 18: partitions are bounded).

A writer is fenced only once no server process carries its run's name
(`storage/incarnation.py`), so every server process of a partitioned writer must end
for the others to move past the IDs it holds. Without these settings nothing ends them
but the OS's keepalive (hours). Each setting goes to both ends:

- the server (session parameters, SET on each new connection): `tcp_keepalives_*` end
  an idle process whose client stopped answering probes, `tcp_user_timeout` one whose
  answer goes unacknowledged, `idle_in_transaction_session_timeout` one idle inside a
  transaction however alive its TCP peer looks (a userspace proxy or pooler in between
  answers the probes for a client that is gone);
- the client (libpq's `keepalives*`, `tcp_user_timeout`): the writer itself learns its
  connection is dead instead of waiting forever for an answer.

A DSN that sets one of them wins: libpq keywords (`keepalives_idle=30`) on the client
side, `options=-c name=value` (or PGOPTIONS) on the server side. The server side is SET
after connecting, not sent in the startup packet's `options`, which PgBouncer refuses.
"""

from __future__ import annotations

import os
import shlex
from typing import Any
from urllib.parse import urlencode

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pydantic import Field

from plait.options import Options

# Linux's limits on TCP_KEEPIDLE/TCP_KEEPINTVL and TCP_KEEPCNT.
_MAX_KEEPALIVE_SECONDS = 32767
_MAX_KEEPALIVE_COUNT = 127
_MAX_MS = 2**31 - 1  # PostgreSQL's and libpq's millisecond settings are 32-bit ints
_CLIENT_KEYWORDS = (
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)


class DatabaseTimeouts(Options):
    """When plait's PostgreSQL connections give up on a silent peer (seconds).

    With the defaults, a writer cut off from the database on a direct connection loses
    every server process within `keepalives_idle + keepalives_interval *
    keepalives_count` = 6 s (unacknowledged data: `tcp_user_timeout`, 6 s), and is
    fenced `fence_after` later. Behind a proxy or pooler that answers for it, only its
    processes idle in a transaction end, after `idle_in_transaction_session_timeout`.
    None leaves a setting as the server or libpq has it."""

    keepalives: bool = True
    """TCP keepalives on both ends; off: the three settings below go unused."""
    keepalives_idle: int = Field(3, ge=1, le=_MAX_KEEPALIVE_SECONDS)
    """Seconds of silence before the first keepalive probe."""
    keepalives_interval: int = Field(1, ge=1, le=_MAX_KEEPALIVE_SECONDS)
    """Seconds between probes."""
    keepalives_count: int = Field(3, ge=1, le=_MAX_KEEPALIVE_COUNT)
    """Unanswered probes until the connection is dead."""
    tcp_user_timeout: float | None = Field(6.0, ge=0.001, le=_MAX_MS / 1000)
    """Data sent and not acknowledged for this long (seconds) ends the connection (both
    ends)."""
    idle_in_transaction_session_timeout: float | None = Field(60.0, ge=0.001, le=_MAX_MS / 1000)
    """The server ends a session idle inside a transaction for this long (seconds), and
    with it the transaction. A transaction that holds a stream ID stalls every reader's
    linear position while it stays open, so keep transactions short; raise this if
    yours wait on something slow between statements."""

    @property
    def dead_after(self) -> float | None:
        """Seconds of silence after which keepalives end an idle connection (None: off)."""
        if not self.keepalives:
            return None
        return float(self.keepalives_idle + self.keepalives_interval * self.keepalives_count)

    def client_params(self, dsn: str) -> dict[str, str]:
        """libpq keywords to connect with, those `dsn` does not set itself."""
        given = _parsed(dsn)
        wanted: dict[str, str] = {"keepalives": "1" if self.keepalives else "0"}
        if self.keepalives:
            wanted["keepalives_idle"] = str(self.keepalives_idle)
            wanted["keepalives_interval"] = str(self.keepalives_interval)
            wanted["keepalives_count"] = str(self.keepalives_count)
        if self.tcp_user_timeout is not None:
            wanted["tcp_user_timeout"] = str(_ms(self.tcp_user_timeout))
        return {k: v for k, v in wanted.items() if given.get(k) in (None, "")}

    def client_dsn(self, dsn: str) -> str:
        """`dsn` with `client_params` added, for code that takes a DSN only (ADBC, Spark
        workers). A URI stays a URI."""
        params = self.client_params(dsn)
        if not params or not _parsed(dsn):
            return dsn
        if dsn.startswith(("postgresql://", "postgres://")):
            return dsn + ("&" if "?" in dsn else "?") + urlencode(params)
        return make_conninfo(dsn, **params)

    def session_settings(self, dsn: str) -> dict[str, str]:
        """Server parameters to SET on a new connection: those `dsn`'s options (or
        PGOPTIONS, which libpq sends when the DSN has none) do not set."""
        wanted: dict[str, str] = {}
        if self.keepalives:
            wanted["tcp_keepalives_idle"] = str(self.keepalives_idle)
            wanted["tcp_keepalives_interval"] = str(self.keepalives_interval)
            wanted["tcp_keepalives_count"] = str(self.keepalives_count)
        if self.tcp_user_timeout is not None:
            wanted["tcp_user_timeout"] = str(_ms(self.tcp_user_timeout))
        if self.idle_in_transaction_session_timeout is not None:
            wanted["idle_in_transaction_session_timeout"] = str(
                _ms(self.idle_in_transaction_session_timeout)
            )
        options = _parsed(dsn).get("options")
        if options is None:
            options = os.environ.get("PGOPTIONS")
        given = options_set(str(options or ""))
        return {k: v for k, v in wanted.items() if k not in given}


def connect_sync(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A plain (synchronous) psycopg connection with `DatabaseTimeouts()`'s client-side
    settings, for the command-line tools and Spark: a partition ends it instead of
    leaving it waiting for hours. What `dsn` sets itself wins."""
    return psycopg.connect(dsn, **{**DEFAULT_TIMEOUTS.client_params(dsn), **kwargs})


def options_set(options: str) -> set[str]:
    """The server parameters a libpq `options` string sets (`-c name=value`,
    `-cname=value`, `--name=value`), names lower-cased with '-' read as '_', as the
    server reads them."""
    try:
        # libpq splits on unescaped white space, with backslash escapes.
        words = shlex.split(options, posix=True)
    except ValueError:
        words = options.split()
    names: set[str] = set()
    pending = False
    for word in words:
        setting = None
        if pending:
            setting, pending = word, False
        elif word == "-c":
            pending = True
        elif word.startswith(("-c", "--")):
            setting = word[2:]
        if setting and "=" in setting:
            names.add(setting.split("=", 1)[0].strip().lower().replace("-", "_"))
    return names


def _parsed(dsn: str) -> dict[str, Any]:
    try:
        return conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return {}  # connecting says what is wrong with it, without quoting it back


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


DEFAULT_TIMEOUTS = DatabaseTimeouts()
