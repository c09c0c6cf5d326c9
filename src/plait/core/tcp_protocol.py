"""The TCP transport's protocol as plain state machines (h11's model): bytes and lines
in, decisions out, no sockets, no clock, no randomness of their own. The asyncio shell
(`plait.replication.tcp_transport`) moves bytes and runs timers; every rule of
`docs/design/replication.md`'s TCP section that is about *what* to do lives here:

- `LineFramer`: bytes to lines, the line limit, the "\\r\\n" ending.
- `route`: which received lines belong to the transport and which to the session.
- `HubHandshake` / `ClientHandshake` (`tcp_handshake`): NAME, CHALLENGE, PROOF,
  SERVER and their proofs.
- `ClientLines`: what the hub takes, relays or refuses from one client, and its bad-line
  budget (`Budget`).
- `Keepalive`: when to ping, and when a silent peer is dead.
"""

from __future__ import annotations

import enum
from collections import deque

from plait.core.commands import (
    BUILTIN,
    COMMAND_NAME,
    CONNECTION_COMMANDS,
    MAX_LINE_BYTES,
    Depart,
    Error,
    Ping,
    Position,
    Rdata,
    Replicate,
    command_name,
    rows_of,
)

LINE_TOO_LONG = f"line too long: the limit is {MAX_LINE_BYTES} bytes"
# Bad lines a client may send the hub: this many at once, then this many a second.
# A well-behaved peer sends none; a mismatched or hostile one is closed once past it.
BAD_LINES_BURST = 100
BAD_LINES_PER_SECOND = 10.0
# REPLICATE makes every instance announce every position to everyone: a client sends
# it once per connection; past this many, each one is dropped and counts as a bad line.
REPLICATE_FREE = 3
# The hub knows these: one its session refuses is bad. Any other well-formed name may be
# an application's command the hub does not register: relayed for its receivers to
# check (`CommandSet.register` allows only names of this form).
_BUILTIN_NAMES = frozenset(command.NAME for command in BUILTIN)
_LOGGED_CHARS = 200


def clip(text: str) -> str:
    """A peer's text, short enough for one log line."""
    return text if len(text) <= _LOGGED_CHARS else text[:_LOGGED_CHARS] + "..."


def encode(lines: list[str]) -> bytes:
    """Lines as they go on the wire."""
    return ("\n".join(lines) + "\n").encode()


# -- framing ------------------------------------------------------------------------------


class LineFramer:
    """Cuts received bytes into lines: each ends in "\\n" ("\\r\\n" is accepted) and holds
    at most `limit` bytes. Lines come out in order with `pop`; once a line over the
    limit is reached (or a partial one grows past it), `too_long` is set, the lines
    before it can still be popped, and nothing after it is taken."""

    def __init__(self, limit: int = MAX_LINE_BYTES) -> None:
        self._limit = limit
        self._partial = bytearray()
        self._lines: deque[bytes] = deque()
        self.too_long = False

    def feed(self, data: bytes) -> None:
        if self.too_long or not data:
            return
        self._partial += data
        if b"\n" in data:
            *complete, rest = self._partial.split(b"\n")
            self._partial = bytearray(rest)
            for line in complete:
                if line.endswith(b"\r"):
                    del line[-1:]
                if len(line) > self._limit:
                    self._give_up()
                    return
                self._lines.append(bytes(line))
        if len(self._partial) > self._limit + 1:  # +1: the "\r" of a "\r\n" to come
            self._give_up()

    def pop(self) -> bytes | None:
        """The next complete line without its ending, or None for none yet."""
        return self._lines.popleft() if self._lines else None

    @property
    def partial(self) -> bool:
        """Whether bytes of an unfinished line are held (a hang-up now cuts a line)."""
        return bool(self._partial)

    @property
    def buffered(self) -> int:
        """Bytes received and not popped as lines yet."""
        return len(self._partial) + sum(len(line) for line in self._lines)

    def _give_up(self) -> None:
        self.too_long = True
        self._partial.clear()


# -- routing a received line ---------------------------------------------------------------


class Route(enum.Enum):
    SESSION = "session"  # the session's (and, at the hub, maybe the others')
    PEER_ERROR = "peer-error"  # the peer answers one of our lines with ERROR: log it
    PING = "ping"  # liveness only
    BAD = "bad"  # a handshake command after the handshake


def route(text: str) -> Route:
    """Where a received (UTF-8) line goes once the handshake is over. A line that is not
    UTF-8 goes to the session as bytes, which answers ERROR."""
    name = command_name(text)
    if name == Error.NAME:
        return Route.PEER_ERROR
    if name == Ping.NAME:
        return Route.PING
    if name in CONNECTION_COMMANDS:
        return Route.BAD
    return Route.SESSION


class Budget:
    """A token bucket: `take` says yes `burst` times at once, then `rate` times a second."""

    def __init__(self, burst: int, rate: float, now: float) -> None:
        self._burst = float(burst)
        self._rate = rate
        self._tokens = float(burst)
        self._since = now

    def take(self, now: float) -> bool:
        self._tokens = min(self._burst, self._tokens + (now - self._since) * self._rate)
        self._since = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class Admit(enum.Enum):
    TAKE = "take"  # to the hub's session, then maybe relayed (`ClientLines.relayed`)
    DROP = "drop"  # a surplus REPLICATE: unanswered, one bad line
    REFUSE = "refuse"  # in another instance's name: ERROR, one bad line


TOO_MANY_BAD_LINES = (
    f"too many bad lines (over {BAD_LINES_BURST}, then {BAD_LINES_PER_SECOND:g} a second):"
    " closing; check this peer's version and configuration"
)


class ClientLines:
    """The hub's rules for the lines of one client named `client`, past the handshake.

    A connection speaks for the instance it named: RDATA, POSITION and DEPART in any
    other instance's name are refused, and nobody but the hub sends in the hub's name
    (`admit`). Every other line goes to the hub's session; it is relayed to the other
    clients unless it is not UTF-8, has no well-formed command name, or is a built-in
    command the session answered with ERROR (`relayed`). Refused, dropped and
    unrelayed lines draw on a budget (`bad`); past it, the client is closed."""

    def __init__(self, hub: str, client: str, now: float) -> None:
        self._hub = hub
        self._client = client
        self._budget = Budget(BAD_LINES_BURST, BAD_LINES_PER_SECOND, now)
        self._replicates = 0
        self.refusal = ""  # why the last line was refused

    def admit(self, line: str | bytes) -> Admit:
        if isinstance(line, bytes):
            return Admit.TAKE
        name = command_name(line)
        refusal = self._impersonation(name, line)
        if refusal is not None:
            self.refusal = refusal
            return Admit.REFUSE
        if name == Replicate.NAME:
            self._replicates += 1
            if self._replicates > REPLICATE_FREE:  # a flood: dropped unanswered
                return Admit.DROP
        return Admit.TAKE

    @staticmethod
    def relayed(line: str | bytes, answered_error: bool) -> bool:
        """Whether a line the session took goes on to the other clients (else: a bad
        line). `answered_error`: the session answered it with ERROR."""
        if isinstance(line, bytes):
            return False  # not UTF-8
        name = command_name(line)
        if not COMMAND_NAME.fullmatch(name):
            return False  # no command could have this name
        if name in _BUILTIN_NAMES:
            return not answered_error
        return True  # an application's command, maybe unknown here: not ours to judge

    def bad(self, now: float) -> bool:
        """One bad line: True once past the budget (close the client)."""
        return not self._budget.take(now)

    def _impersonation(self, name: str, line: str) -> str | None:
        hub, client = self._hub, self._client
        if rows_of(line, hub):  # the hub's session drops these unread, as its own echoes
            return f"{name} of {hub} refused: only {hub} sends its own (two instances named so?)"
        if name in (Rdata.NAME, Position.NAME):
            writer = field_of(line, 2)
            if writer is None or writer == client:
                return None
            if name == Rdata.NAME:
                return (
                    f"RDATA of {writer} refused: this connection is {client}, and only "
                    f"{writer} sends its own rows"
                )
            return (
                f"POSITION of {writer} refused: this connection is {client}, and only "
                f"{writer} sends its own (a fence of another writer goes as FENCED, which "
                "receivers check against the database)"
            )
        if name == Depart.NAME:
            departing = field_of(line, 1)
            if departing is not None and departing != client:
                return (
                    f"DEPART of {departing} refused: this connection is {client}, and "
                    f"only {departing} departs"
                )
        return None


def field_of(line: str, index: int) -> str | None:
    """The `index`th space-separated field of `line` (0: the command name), found without
    splitting the rest (a row may be a MiB); None when it is missing or empty."""
    start = 0
    for _ in range(index):
        start = line.find(" ", start) + 1
        if start == 0:
            return None
    end = line.find(" ", start)
    found = line[start:] if end < 0 else line[start:end]
    return found or None


# -- liveness -----------------------------------------------------------------------------


class Keepalive:
    """PING every `ping_interval`; a peer silent for `dead_after` is dead. The shell
    calls `received` for every line and `due` whenever it wakes, then sleeps until
    `wake_at`."""

    def __init__(self, ping_interval: float, dead_after: float, now: float) -> None:
        self._ping_interval = ping_interval
        self._dead_after = dead_after
        self.last_received = now
        self._next_ping = now + ping_interval

    def received(self, now: float) -> None:
        self.last_received = now

    def due(self, now: float) -> tuple[bool, float | None]:
        """(whether to PING now, seconds silent when the peer is dead, else None)."""
        silent = now - self.last_received
        if silent >= self._dead_after:
            return False, silent
        if now >= self._next_ping:
            self._next_ping = now + self._ping_interval
            return True, None
        return False, None

    @property
    def wake_at(self) -> float:
        return min(self._next_ping, self.last_received + self._dead_after)
