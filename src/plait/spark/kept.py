"""The catalog connection (psycopg) each process keeps per DSN where Spark plans a read
or asks for offsets: its planning workers are reused, and each read would otherwise
connect two or three times."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

from plait.errors import ConfigError
from plait.storage import catalog

T = TypeVar("T")

# Catalog connections (psycopg) kept per process and DSN where Spark plans a read or
# asks for offsets: its planning workers are reused, and each read would otherwise
# connect two or three times. A kept one the server closed raises, and `Kept` tries
# once more on a new one. Row reads keep theirs only while their socket shows it whole
# (`read_connections`).
_KEPT: dict[str, Any] = {}


class Kept:
    """An `Ask` on the catalog connection this process keeps for `dsn`."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def __call__(self, work: Callable[[Any], T], /) -> T:
        """`work(conn)` on the kept connection; once more on a new one when it fails
        (the kept one may have broken since; a real error fails again)."""
        for attempt in (1, 2):
            conn = _KEPT.get(self.dsn)
            if conn is None:
                conn = _KEPT[self.dsn] = catalog.connect(self.dsn)
            try:
                return work(conn)
            except ConfigError:
                raise  # a verdict on the options, not a broken connection
            except Exception:
                self.forget()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def forget(self) -> None:
        conn = _KEPT.pop(self.dsn, None)
        if conn is not None:
            with contextlib.suppress(Exception):  # broken already: a new one replaces it
                conn.close()
