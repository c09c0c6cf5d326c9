"""In-memory streams: state that lives only in its writer's memory (typing notices,
presence), replicated like any stream but never stored in PostgreSQL. No I/O.

Rows are full replacements keyed by the application (say, one per room): a reader that
missed some needs only the latest row of each key, so the stream keeps just that.

Tokens follow the clock: each write takes the current time in microseconds, or the
previous token plus one when that is larger. A writer that restarts therefore
continues above every token of its previous run (unless that run wrote faster than
one row per microsecond for longer than the restart took), and readers never see its
position go backwards. What a restart loses is the rows: a reader asking for rows
from before this run's start gets the whole current state, marked `reset`, and must drop
what it kept of this writer before applying it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plait.streams.outbox import Outbox


@dataclass(frozen=True, slots=True)
class ReadPage:
    """Rows (token, row) sorted by token; every row with a token in (from, upto] is
    included; `limited`: more may follow above `upto`; `reset`: the source lost rows
    at or below `from`, so these rows are its whole state, replacing what the reader kept."""

    rows: list[tuple[int, Any]]
    upto: int
    limited: bool
    reset: bool = False


def _now_us() -> int:
    return time.time_ns() // 1000


@dataclass
class MemoryStream:
    """The writer's side of an in-memory stream: the latest row per key, in token order."""

    name: str
    clock: Callable[[], int] = _now_us
    start: int = 0
    _token: int = field(init=False)
    # Insertion order is token order: a rewritten key is moved to the end.
    _rows: dict[str, tuple[int, Any]] = field(init=False, default_factory=dict)
    # Each write posts that the position moved; replication's sender takes the rows.
    outbox: Outbox = field(init=False, default_factory=Outbox)

    def __post_init__(self) -> None:
        if self.start == 0:
            self.start = self.clock()
        if self.start < 1:
            raise ValueError("an in-memory stream's start token must be positive")
        self._token = self.start

    @property
    def position(self) -> int:
        """The token of the latest write (the start token before any)."""
        return self._token

    def write(self, key: str, row: Any) -> int:
        """Replace the row of `key`; returns its token."""
        self._token = max(self._token + 1, self.clock())
        self._rows.pop(key, None)
        self._rows[key] = (self._token, row)
        self.outbox.moved()
        return self._token

    def get(self, key: str) -> Any:
        entry = self._rows.get(key)
        return None if entry is None else entry[1]

    def read(self, from_exclusive: int, to_inclusive: int, limit: int) -> ReadPage:
        """The latest rows with tokens in (from, to], at most `limit` of them."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        reset = from_exclusive < self.start
        low = 0 if reset else from_exclusive
        found: list[tuple[int, Any]] = []
        for token, row in reversed(self._rows.values()):
            if token <= low:
                break
            if token <= to_inclusive:
                found.append((token, row))
        found.reverse()
        if len(found) > limit:
            found = found[:limit]
            return ReadPage(found, found[-1][0], True, reset)
        return ReadPage(found, to_inclusive, False, reset)
