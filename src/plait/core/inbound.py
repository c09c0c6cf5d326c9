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

Bounded memory (R-RP-9): commands wait in a `Backlog` per stream and connection, of at
most `bound` commands. Past it, the backlog drops every command it holds and keeps, per
writer, one `Resync` to the highest position those commands named: the rows they
carried are read from the source instead (the database, or the writer over HTTP for an
in-memory stream). Why no row is skipped or repeated:
- A `Resync` takes the dropped commands' place in the writer's order, so everything
  taken before it is handled before it, and nothing from after it is handled before.
- Handling it forgets the writer's held batch rows and that it was caught up, then
  reads (current, upto] and counts the writer's RDATA again: RDATA after it carries
  tokens above `upto` (a writer sends its rows in token order, and a POSITION only
  after its rows), so rows already delivered or read are dropped as stale.
- The cut never falls inside a batch: a writer whose last dropped command was a
  `batch` row gets its `Resync` only at its next numbered RDATA or POSITION (that
  command and the batch rows before it are dropped too, and counted in `upto`).
  Meanwhile the backlog holds one number for it, not its commands.
- A FENCED (another instance's word that a writer was fenced) never folds into a
  `Resync`, which the shell takes as the writer's own word: the backlog keeps the
  highest one per writer instead, after the `Resync`s, for the shell to prove against
  the database as when it arrives. Believed or not, it only ever moves a writer forward.

A connection that ends leaves its backlogs to be handled all the same (the shell drains
them): what arrived was sent once, and a writer that departed sends it nowhere again.
`ended` gives a writer cut off inside a batch its `Resync` at once.

A writer that leaves cleanly sends DEPART (R-RP-8). Its rows sent before it must still
be handled, and only then does its RDATA stop counting (until its next POSITION, should
it come back: a restarted writer's tokens follow its answer to REPLICATE). So a DEPART
is not handled when it arrives but queued, as a `Departure`, in each stream's backlog
behind that writer's commands:
- An overflow keeps it in the writer's place: a `Resync` for what the writer sent
  before its (last) departure, the `Departure` (counting the departures it stands for),
  then what came after it (a restarted writer's commands), as for any writer.
  Two departures of one writer in one overflow fold into one: the earlier is then
  handled after the rows of the life between them (never before its own rows; its
  listeners may run late, and a writer that came back in between may be reported gone
  after its new rows, until its next POSITION).
- A writer cut off inside a batch that departs ends its cut: the batch never ends.
  Its position stays below the batch, whose rows are read at its next POSITION (its
  return, or a fence).

The I/O shell feeds commands in per-stream order, does the catch-up reads this module
asks for, calls `caught_up` after them, and delivers what it returns.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from plait.core.commands import Fenced, Position, Rdata

# Commands a stream may have waiting on one connection (replication.inbound_queue).
DEFAULT_INBOUND_QUEUE = 10_000


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
    `catch_up_from` is set, then advance the writer to `advance_to` (when set), then,
    when `counts_rows`, call `caught_up(stream, instance)`."""

    stream: str
    instance: str
    catch_up_from: int | None
    advance_to: int | None
    # Whether the writer's RDATA counts on this connection afterwards: only after its
    # own POSITION, which comes after the RDATA it sent before (R-RP-2); a FENCED of
    # another sender is in no order with the writer's lines.
    counts_rows: bool = True


@dataclass(frozen=True, slots=True)
class Resync:
    """Stands for commands of `instance` a full `Backlog` dropped: read its rows up to
    `upto` (internal) from the source, then count its RDATA again. Never on the wire."""

    stream: str
    instance: str
    upto: int


@dataclass(frozen=True, slots=True)
class Departure:
    """`instance` left (DEPART), `count` times: queued per stream behind the commands of
    it that arrived before, so they are handled first. Never on the wire."""

    stream: str
    instance: str
    count: int = 1


Queued = Rdata | Position | Fenced | Resync | Departure


@dataclass(slots=True)
class Backlog:
    """The commands of one stream waiting on one connection: never more than `bound`
    (or, right after an overflow, one `Resync` per writer, and for a writer that
    departed meanwhile a `Resync` and a `Departure` before it, when that is more; and
    one FENCED per writer)."""

    stream: str
    bound: int
    # Tokens on the wire are `sign` times the internal ones (backwards streams count
    # down); `Resync.upto` is internal, as the positions the shell compares it with.
    sign: int = 1
    _commands: deque[Queued] = field(default_factory=deque)
    # Writers cut off inside a batch: the highest position their dropped commands
    # named (None: only batch rows so far), until their next numbered command.
    _cut: dict[str, int | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.bound < 1:
            raise ValueError("a backlog needs a bound of at least one command")

    def __len__(self) -> int:
        return len(self._commands)

    def idle(self) -> bool:
        """Nothing waits, nor is any writer cut off: a command may be handled at once."""
        return not self._commands and not self._cut

    def push(self, command: Rdata | Position | Fenced | Departure | Resync) -> bool:
        """Queue `command`; True when the backlog overflowed and dropped what it held.
        (A `Resync` comes from the shell when a row it took failed.)"""
        if isinstance(command, Fenced):
            self._commands.append(command)  # not the writer's own: no part in its batches
        elif (writer := command.instance) not in self._cut:
            self._commands.append(command)
        elif isinstance(command, Departure):
            # It left inside the batch: no numbered command of it is coming to end it.
            upto = self._cut.pop(writer)
            if upto is not None:
                self._commands.append(Resync(self.stream, writer, upto))
            self._commands.append(command)
        else:
            upto = _max(self._cut[writer], self._upto(command))
            if isinstance(command, Rdata) and command.token is None:
                self._cut[writer] = upto  # still inside the batch
                return False
            assert upto is not None
            del self._cut[writer]
            self._commands.append(Resync(self.stream, writer, upto))
        if len(self._commands) <= self.bound:
            return False
        self._drop()
        return True

    def pop(self) -> Queued | None:
        """The next command to handle, oldest first; None when none waits."""
        return self._commands.popleft() if self._commands else None

    def ended(self) -> None:
        """The connection ended: no numbered command will end a cut writer's batch on
        it, so what its dropped commands named is read now, as a `Resync` (the batch
        rows above it wait for the writer's next POSITION elsewhere, or a fence)."""
        for writer, upto in self._cut.items():
            if upto is not None:
                self._commands.append(Resync(self.stream, writer, upto))
        self._cut.clear()

    def _upto(self, command: Rdata | Position | Resync) -> int | None:
        if isinstance(command, Resync):
            return command.upto
        if isinstance(command, Position):
            return self.sign * command.new
        return None if command.token is None else self.sign * command.token

    def _drop(self) -> None:
        dropped: dict[str, _Dropped] = {}  # in order of first appearance
        fences: dict[str, Fenced] = {}  # the highest per writer
        for command in self._commands:
            if isinstance(command, Fenced):
                kept = fences.get(command.instance)
                if kept is None or self.sign * command.position > self.sign * kept.position:
                    fences[command.instance] = command
                continue
            of_writer = dropped.setdefault(command.instance, _Dropped())
            if isinstance(command, Departure):
                of_writer.departed(command.count)
            else:
                of_writer.add(self._upto(command))
        self._commands.clear()
        for writer, of_writer in dropped.items():
            if of_writer.before is not None:
                self._commands.append(Resync(self.stream, writer, of_writer.before))
            if of_writer.departures:
                self._commands.append(Departure(self.stream, writer, of_writer.departures))
            if of_writer.inside_batch:
                self._cut[writer] = of_writer.since
            elif of_writer.since is not None:
                self._commands.append(Resync(self.stream, writer, of_writer.since))
        self._commands.extend(fences.values())


@dataclass(slots=True)
class _Dropped:
    """What an overflow dropped of one writer: the highest position named before its
    last departure, how many departures, and the highest since (None: none named)."""

    before: int | None = None
    departures: int = 0
    since: int | None = None
    inside_batch: bool = False

    def add(self, upto: int | None) -> None:
        self.since = _max(self.since, upto)
        self.inside_batch = upto is None

    def departed(self, count: int) -> None:
        # Batch rows cut by a departure are never ended: the writer's position stays
        # below them, and its return (or a fence) reads them.
        self.before = _max(self.before, self.since)
        self.departures += count
        self.since = None
        self.inside_batch = False


def _max(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


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
        """A writer announced its position; `current` is how far we have seen it.

        A writer never sends a POSITION inside one of its batches (a page of rows goes
        out whole, its POSITION last), so batch rows still held then were cut off by
        the writer's death or a lost link: a previous life's, never to be ended by
        their numbered row. They are dropped, or they would be handed over with the
        next batch, after the catch-up had read them from the source: twice."""
        if command.instance == self.own_name:
            return None
        self._held.pop((command.stream, command.instance), None)
        return self._plan(command, current)

    def fenced(self, command: Fenced, current: int) -> Plan | None:
        """Another instance fenced the writer (internal `position`): catch up and
        advance as for its POSITION `position -> position`, but its RDATA counts here no
        sooner for it (a row it sent before, dropped while it did not count, would be
        stepped over by its next POSITION), and held rows of a batch it may fall inside
        are kept. None when there is nothing to do: the shell then needs no proof."""
        if command.instance == self.own_name or command.position <= current:
            return None
        position = Position(command.stream, command.instance, command.position, command.position)
        return dataclasses.replace(self._plan(position, current), counts_rows=False)

    def _plan(self, command: Position, current: int) -> Plan:
        advance_to = command.new if command.new > current else None
        catch_up_from = current if advance_to is not None and current < command.prev else None
        return Plan(command.stream, command.instance, catch_up_from, advance_to)

    def resync(self, command: Resync, current: int) -> Plan | None:
        """A `Backlog` dropped commands of a writer: forget its held batch rows and that
        it was caught up (until `caught_up`), and read what it had sent, up to `upto`."""
        key = (command.stream, command.instance)
        self._connected.discard(key)
        self._held.pop(key, None)
        if command.instance == self.own_name:
            return None
        behind = command.upto > current
        return Plan(
            command.stream,
            command.instance,
            current if behind else None,
            command.upto if behind else None,
        )

    def caught_up(self, stream: str, instance: str) -> None:
        """The shell did what a `Plan` asked: that writer's RDATA counts from now on."""
        self._connected.add((stream, instance))

    def departed(self, command: Departure) -> None:
        """That writer left, after the commands of it handled so far on this stream:
        should it come back, its RDATA counts only after its next POSITION here."""
        key = (command.stream, command.instance)
        self._connected.discard(key)
        self._held.pop(key, None)

    def lost(self) -> None:
        """The connection dropped: everything starts over on the next one."""
        self._connected.clear()
        self._held.clear()
