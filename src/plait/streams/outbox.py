"""The one hand-off from a writer to replication: what this process has to tell the
other processes about one stream, kept until replication's sender takes it.

The writer's side (the ID generator, or an in-memory stream) only posts here, and never
runs replication code: a post schedules the one reader (replication's sender) on the
event loop, once for all posts made before it runs, and the reader drains. So a write
costs no more with replication than without, and writes that complete together are sent
together.

What is posted (IDs internal, as the generator keeps them):
- `written(ids, rows)`: own IDs about to complete, with their rows when the write returned
  them whole (the sender then sends them without a query), else marked not known;
- `unknown(low, high)`: a write whose outcome was lost may have taken IDs in (low, high]
  that nobody can name; a range meeting it is always read back;
- `moved()`: this writer's own position moved after a write: send now (R-RP-4);
- `fenced(writer, position)`: this process fenced a dead writer; replication announces
  it and catches the writer's rows up before its position moves here.

A move with no write of this writer's (the idle rule, R-ID-5) is posted nowhere: the
sender's announcer compares the position with what it sent every interval, and sends
it then, not once per position heard.

Writes are kept only once the outbox is open (`open`, before the first write), so a
process without replication keeps nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from plait.core.own_writes import OwnWrites
from plait.storage.stream_tables import StreamRow


class Outbox:
    """What one stream's writer has posted for replication and it has not taken yet."""

    __slots__ = ("_fences", "_loop", "_reader", "_scheduled", "_sign", "_writes")

    def __init__(self, sign: int = 1) -> None:
        self._sign = sign  # rows carry signed IDs; the outbox keys them internally
        self._writes: OwnWrites[StreamRow] | None = None
        self._fences: list[tuple[str, int]] = []
        self._reader: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False  # the reader is on the loop's ready queue already

    @property
    def is_open(self) -> bool:
        """Whether a sender drains this outbox (writes are kept for it)."""
        return self._writes is not None

    def open(self, reader: Callable[[], None] | None = None) -> None:
        """Keep what the sender needs from every write from now on (call it before the
        first write: an ID completed before is read back, never sent from here).
        `reader`, once given, is what the outbox schedules after posts (in a running
        event loop: the one it schedules on)."""
        if self._writes is None:
            self._writes = OwnWrites()
        if reader is not None:
            self._reader = reader
            self._loop = asyncio.get_running_loop()
            if self._fences:  # posted before there was a reader to schedule
                self._schedule()

    def _schedule(self) -> None:
        if self._reader is not None and not self._scheduled:
            assert self._loop is not None
            self._scheduled = True
            self._loop.call_soon(self._read)

    def _read(self) -> None:
        self._scheduled = False
        assert self._reader is not None
        self._reader()

    # -- posted by the writer ------------------------------------------------------------

    def written(self, ids: list[int], rows: list[StreamRow] | None) -> None:
        """`ids` (sorted) are about to complete, with these rows, or None when the
        rows are not known."""
        writes = self._writes
        if writes is None:
            return
        by_id: dict[int, list[StreamRow]] | None = None
        if rows is not None:
            by_id, sign = {}, self._sign
            for row in rows:
                by_id.setdefault(sign * row.stream_id, []).append(row)
        writes.record(ids, by_id)

    def unknown(self, low: int, high: int) -> None:
        """Own IDs in (low, high] may have been written, but nobody can name them."""
        if self._writes is not None:
            self._writes.unknown(low, high)

    def moved(self) -> None:
        """The writer's own position moved after a write: the sender sends now."""
        self._schedule()

    def fenced(self, writer: str, position: int) -> None:
        """This process fenced dead `writer` up to `position` (signed)."""
        self._fences.append((writer, position))
        self._schedule()

    # -- taken by the sender -------------------------------------------------------------

    def take_fences(self) -> list[tuple[str, int]]:
        """The fences posted since the last call, oldest first."""
        fences, self._fences = self._fences, []
        return fences

    def known(
        self, from_exclusive: int, to_inclusive: int
    ) -> list[tuple[int, list[StreamRow]]] | None:
        """(ID, rows) of every own write in (from, to], in order, when all are known
        here; None when the range must be read back from the database."""
        return None if self._writes is None else self._writes.known(from_exclusive, to_inclusive)

    def sent_upto(self, upto: int) -> None:
        """Everything at or below `upto` was sent (or read back): forget it."""
        if self._writes is not None:
            self._writes.drop_upto(upto)
