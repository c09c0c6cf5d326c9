"""What one replication connection does with the RDATA and POSITION it receives. No I/O.

Per connection, stream and writer (R-RP-2, R-RP-3):
- RDATA is ignored until a POSITION of its writer for its stream was processed on this
  connection: rows sent before that are covered by the catch-up the POSITION triggers,
  because a writer's POSITION is never below a token it already sent RDATA for. (Per
  writer, not per stream as SPEC.md words it: a row of writer B accepted after writer
  A's POSITION would advance B past B's rows sent before this connection existed.)
- Rows tagged `batch` are held per (stream, writer) until the row with the number.
- Rows whose token is at or below what this process has already seen of that writer
  are dropped, with the batch they end.
- A POSITION `prev -> new` means the writer had no rows in (prev, new]: when this
  process is at or past `prev`, it just advances; when it is behind `prev`, it first
  reads (current, new] (from the database, or from the writer over HTTP).

The I/O shell feeds commands in per-stream order, does the catch-up reads this module
asks for, calls `caught_up` after them, and delivers what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plait.core.commands import Position, Rdata


@dataclass(frozen=True, slots=True)
class Deliver:
    """Rows of one writer at one token, to hand to the application, in order."""

    stream: str
    instance: str
    token: int
    rows: list[Any]


@dataclass(frozen=True, slots=True)
class Plan:
    """What a POSITION asks for: read (catch_up_from, advance_to] first when
    `catch_up_from` is set, then advance the writer to `advance_to` (when set), then
    call `caught_up(stream, instance)`."""

    stream: str
    instance: str
    catch_up_from: int | None
    advance_to: int | None


@dataclass(slots=True)
class Inbound:
    """The state of one connection: writers caught up on it, and held batches."""

    own_name: str
    _connected: set[tuple[str, str]] = field(default_factory=set)
    _held: dict[tuple[str, str], list[Any]] = field(default_factory=dict)

    def is_connected(self, stream: str, instance: str) -> bool:
        return (stream, instance) in self._connected

    def all_connected(self, writers: set[tuple[str, str]]) -> bool:
        """Whether every (stream, writer) caught up on this connection: the shell counts
        the connection as up (and resets its reconnect backoff) only then."""
        return writers <= self._connected

    def rdata(self, command: Rdata, current: int) -> Deliver | None:
        """A row arrived; `current` is how far this process has seen that writer."""
        key = (command.stream, command.instance)
        if command.instance == self.own_name or key not in self._connected:
            return None  # our own echo, or that writer not caught up on this connection
        if command.token is None:
            self._held.setdefault(key, []).append(command.row)
            return None
        rows = self._held.pop(key, [])
        rows.append(command.row)
        if command.token <= current:
            return None  # seen already (caught up past it): the whole batch is stale
        return Deliver(command.stream, command.instance, command.token, rows)

    def position(self, command: Position, current: int) -> Plan | None:
        """A writer announced its position; `current` is how far we have seen it."""
        if command.instance == self.own_name:
            return None
        advance_to = command.new if command.new > current else None
        catch_up_from = current if advance_to is not None and current < command.prev else None
        return Plan(command.stream, command.instance, catch_up_from, advance_to)

    def caught_up(self, stream: str, instance: str) -> None:
        """The shell did what a `Plan` asked: that writer's RDATA counts from now on."""
        self._connected.add((stream, instance))

    def departed(self, instance: str) -> None:
        """That instance left: should it come back, its RDATA counts only after its next
        POSITION on this connection."""
        for key in [k for k in self._connected | self._held.keys() if k[1] == instance]:
            self._connected.discard(key)
            self._held.pop(key, None)

    def lost(self) -> None:
        """The connection dropped: everything starts over on the next one."""
        self._connected.clear()
        self._held.clear()
