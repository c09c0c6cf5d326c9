"""The ADBC connection a Spark Python worker keeps between its row reads.

Connecting costs 15-25 ms on one host (the driver loads the server's type catalogue),
which was a read's whole lead over Spark's JDBC source (BENCHMARKS.md). But the ADBC
driver held at 1.8 (pyproject.toml) aborts the process (`std::logic_error`, exit 134)
when a query meets a connection that has broken: its error has no SQLSTATE, and the
driver builds a C++ string from the missing one. No retry can catch that, so a kept
connection is used again only when its socket shows it is whole:

- the socket is found once, when the connection is made, as the one socket that
  appeared in `/proc/self/fd` across the connect (anything else, or no `/proc`:
  the connection is not kept);
- before reuse, a non-blocking peek at it must find nothing to read: a server that
  ended the session (pg_terminate_backend, a shutdown, `idle_session_timeout`) sends
  an error and closes, a restart or a reset shows as end of file or an error, and TCP
  keepalives turn a network gone silent into an error within `dead_after` seconds
  (storage/timeouts.py);
- and it was last used less than `REUSE_WITHIN` seconds ago, which bounds the one case
  the peek cannot see: a network gone silent so recently that keepalives have not
  noticed yet. A connection idle for longer is closed and a new one made.

A read that does not finish (an error, or Spark stopping early) closes its connection.
A worker holds at most one idle connection per DSN between reads; one too old to be
used again is closed at the worker's next read.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

REUSE_WITHIN = 1.0  # seconds since the last read ended
_FDS = "/proc/self/fd"


@dataclass(frozen=True)
class Held:
    """A finished read's connection and the socket it talks on."""

    conn: Any
    fd: int
    link: str  # what /proc/self/fd/<fd> pointed at: "socket:[inode]"
    since: float  # time.monotonic() when its last read ended


def new_socket(before: Mapping[int, str], after: Mapping[int, str]) -> tuple[int, str] | None:
    """The one socket that is in `after` and not in `before` (descriptor, link), or None
    when there is not exactly one."""
    added = [(fd, link) for fd, link in after.items() if before.get(fd) != link]
    sockets = [(fd, link) for fd, link in added if link.startswith("socket:")]
    return sockets[0] if len(sockets) == 1 else None


def reusable(held_for: float, link_now: str | None, link: str, peek: Callable[[], bool]) -> bool:
    """Whether a kept connection may take the next query: recent, its descriptor still the
    same socket, and `peek()` (nothing to read, not closed) true."""
    return held_for < REUSE_WITHIN and link_now == link and peek()


def _sockets() -> dict[int, str]:
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FDS)
    except OSError:
        return found
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            link = os.readlink(f"{_FDS}/{name}")
            if link.startswith("socket:"):
                found[int(name)] = link
    return found


def _link(fd: int) -> str | None:
    try:
        return os.readlink(f"{_FDS}/{fd}")
    except OSError:
        return None


def _quiet(fd: int) -> bool:
    """Nothing to read on `fd` and the peer has not closed it (a peek on a copy of the
    descriptor: the connection's own is left as it is)."""
    try:
        probe = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        probe.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True  # open, and nothing waiting
    except OSError:
        return False  # reset, timed out by keepalives, or not a socket
    finally:
        probe.close()  # closes the copy only
    return False  # end of file, or an error message the server sent before closing


_HELD: dict[str, Held] = {}


class ReadConnections:
    """The connections of one process's row reads, by DSN (one per DSN: a Python worker
    runs one task at a time)."""

    def __init__(self, connect: Callable[[str], Any]) -> None:
        self._connect = connect

    @contextlib.contextmanager
    def connection(self, dsn: str) -> Iterator[Any]:
        """A connection for one read: the kept one when it is whole, else a new one.
        Kept again when the read finishes; closed when it fails or stops early."""
        _sweep(dsn)
        held = _HELD.pop(dsn, None)
        if held is not None and reusable(
            time.monotonic() - held.since, _link(held.fd), held.link, lambda: _quiet(held.fd)
        ):
            conn, fd, link = held.conn, held.fd, held.link
        else:
            if held is not None:
                _close(held.conn)
            before = _sockets()
            conn = self._connect(dsn)
            found = new_socket(before, _sockets())
            fd, link = found if found is not None else (-1, "")
        try:
            yield conn
        except BaseException:
            _close(conn)
            raise
        if fd < 0:
            _close(conn)
        else:
            _HELD[dsn] = Held(conn, fd, link, time.monotonic())


def _sweep(but: str) -> None:
    """Close the connections kept for other DSNs that are too old to be used again (a
    worker that read from several databases keeps no idle connection to each)."""
    now = time.monotonic()
    for dsn, held in list(_HELD.items()):
        if dsn != but and now - held.since >= REUSE_WITHIN:
            _close(_HELD.pop(dsn).conn)


def _close(conn: Any) -> None:
    with contextlib.suppress(Exception):  # broken already: nothing to tidy
        conn.close()
