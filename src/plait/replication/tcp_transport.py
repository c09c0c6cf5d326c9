"""TCP replication transport: a hub on one instance, clients on the others (R-RP-1).

The rules this module keeps:
- Framing: a command is one UTF-8 line ending in "\\n" ("\\r\\n" is accepted) of at most
  MAX_LINE_BYTES; a longer line is answered with ERROR and the connection closes.
- Handshake: the client sends NAME; only once it is over does either end call
  `Handler.open`, and nothing but the handshake is taken before. Without a secret the
  hub answers SERVER. With `replication.secret` the two prove to each other that they
  hold it: the hub answers CHALLENGE <hub> <hub-nonce>, the client PROOF <nonce> <proof>,
  the hub SERVER <hub> <proof>. A proof is HMAC-SHA256 under the secret of its role
  ("client" or "hub", so neither can be reflected back), both names (so the name proven
  is the connection's) and both fresh random nonces (so no old handshake replays). The
  client proves first: the hub computes nothing with the secret for whoever connects.
  A hub with a secret refuses a client without one, a client with a secret refuses a
  hub that did not ask for its proof, and either end refuses a wrong proof: ERROR, a
  hang-up, and a warning that says to set the same replication.secret everywhere. A hub
  refuses to listen off loopback without a secret. So does a hub that gets anything else
  first, or no finished handshake within its handshake timeout: ERROR and close.
- Names: a connection speaks for the instance it named (and proved, with a secret). The
  hub refuses RDATA, POSITION and DEPART in any other instance's name (ERROR, a bad
  line, taken by no session and relayed to nobody). A FENCED, about another writer by
  nature, is relayed: receivers check it against the database. Nobody but the hub
  sends in the hub's name. One connection holds a name at a time: a newer
  one replaces the older (the instance reconnected before the hub noticed).
- PING, ERROR and the handshake's commands (NAME, CHALLENGE, PROOF, SERVER) belong to
  the transport: never relayed, never given to a session (an ERROR received is logged).
  The hub hands every other line from a client to its own session and relays it,
  verbatim, to every other client unless the session answered it with ERROR: a line
  that is not UTF-8, has no well-formed command name, or is a built-in command with bad
  arguments reaches no other peer. Application commands (other well-formed names) are
  relayed whatever the hub's session said, as the hub need not register them. The
  relay goes out before anything the hub's handler sent while taking the line, so all
  of them see the hub's order.
- A hostile or broken client costs the others a bounded share: the hub's reader yields
  every `_YIELD_EVERY` lines (a flood must not starve the other connections); bad lines
  (those not relayed above, handshake commands again, REPLICATEs past the first few)
  draw on a budget of `_BAD_LINES_BURST` plus `_BAD_LINES_PER_SECOND`, past which the
  client gets ERROR and is closed. At most `_MAX_HANDSHAKING_PER_ADDRESS` connections
  from one address, and `_MAX_HANDSHAKING` in all, wait in the handshake at once; more
  are refused on the spot, so one address cannot lock the others out. Warnings about a
  peer (bad lines, ERRORs, failed handshakes) take at most one log line per
  `_LOG_INTERVAL` per address: the first at once, then a count.
- `Link.send` never waits: a connection queues at most `send_queue` lines (and
  `_MAX_BUFFERED_BYTES`) for its writer task. A peer too slow to keep up gets ERROR and
  is closed (it catches up after reconnecting); lines sent to a closed connection are
  dropped. With the reader's limit of two lines, what the hub holds for one peer stays
  bounded whatever it sends or fails to read.
- Each end sends PING every `ping_interval` and closes a peer silent for `dead_after`.
- Every task and timer is owned: a connection's reader, writer, pinger and wait_up
  watcher end when it closes; the hub and the client end their connections, and their
  log timers, in `stop()`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import ipaddress
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from plait.core.backoff import Backoff
from plait.core.commands import (
    BUILTIN,
    COMMAND_NAME,
    MAX_LINE_BYTES,
    Challenge,
    Command,
    CommandSet,
    Depart,
    Error,
    Name,
    Ping,
    Position,
    Proof,
    Rdata,
    Replicate,
    Server,
    rows_of,
    to_line,
)
from plait.errors import CommandParseError, ConfigError
from plait.ports import is_loopback
from plait.replication import defaults
from plait.replication.link import (
    CONNECTION_COMMANDS,
    Handler,
    Session,
    command_name,
    wait_set,
)
from plait.replication.metrics import ReplicationMetrics
from plait.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# The stream reader's limit: one byte past the line limit, for the "\r" of "\r\n".
_READ_LIMIT = MAX_LINE_BYTES + 1
# How long a closing connection lets the peer read what was sent and hang up itself
# before the socket is cut (a peer that does not read would otherwise hold it forever).
_CLOSE_GRACE = 1.0
_LINE_TOO_LONG = f"line too long: the limit is {MAX_LINE_BYTES} bytes"
_HANDSHAKE_COMMANDS = CommandSet()
# The reader lets the other tasks run after this many lines read back to back: a line
# already buffered is read without yielding, so one peer's flood would otherwise hold
# the event loop, and every other connection's reader, writer and pinger with it.
_YIELD_EVERY = 64
# Bad lines a client may send the hub: this many at once, then this many a second.
# A well-behaved peer sends none; a mismatched or hostile one is closed once past it.
_BAD_LINES_BURST = 100
_BAD_LINES_PER_SECOND = 10.0
# REPLICATE makes every instance announce every position to everyone: a client sends
# it once per connection; past this many, each one is dropped and counts as a bad line.
_REPLICATE_FREE = 3
# Bytes held for one peer (queued lines and bytes not yet sent) past which it counts as
# too slow, whatever `send_queue` allows: lines can be up to MAX_LINE_BYTES each.
_MAX_BUFFERED_BYTES = 64 << 20
# Connections in the handshake at once, from one address and from all; more are refused
# on the spot, so that sockets that never finish the handshake cannot pile up (each is
# also cut at the handshake timeout), and one address cannot take every slot.
_MAX_HANDSHAKING_PER_ADDRESS = 8
_MAX_HANDSHAKING = 256
# Warnings about one peer address: one log line per this many seconds at most.
_LOG_INTERVAL = 10.0
# Peer addresses whose warnings are counted apart; past this many, the rest share one.
_MAX_LOGGED_ADDRESSES = 1024
# The longest text of a peer's that goes into a log line.
_LOGGED_CHARS = 200
# Random bytes in each nonce of the handshake.
_NONCE_BYTES = 16
# Proofs cover this first: another protocol's (or version's) HMAC can never pass.
_PROOF_LABEL = "plait-tcp-1"
_SAME_SECRET = "set the same replication.secret on every instance"
# Connections the kernel may hold for the hub to accept (asyncio's default is 100): a
# burst past it (every client reconnecting at once, or a flood) leaves connections
# established for the client but unseen by the hub, for seconds of SYN-ACK retries.
_BACKLOG = 1024
# The hub knows these: one its session refuses is bad. Any other well-formed name may be
# an application's command the hub does not register: relayed for its receivers to
# check (`CommandSet.register` allows only names of this form).
_BUILTIN_NAMES = frozenset(command.NAME for command in BUILTIN)


class _LineTooLongError(Exception):
    """The peer sent a line over MAX_LINE_BYTES."""


async def _read_line(reader: asyncio.StreamReader) -> bytes:
    """The next line without its terminator. Raises `IncompleteReadError` at EOF,
    `_LineTooLongError` for a line over the limit, `OSError` when the connection failed."""
    try:
        raw = await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise _LineTooLongError from None
    line = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
    if len(line) > MAX_LINE_BYTES:
        raise _LineTooLongError
    return line


def _encode(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


async def _close_stream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, linger: bool
) -> None:
    """Hang up, flushing what was written; a peer that does not read is cut off after
    `_CLOSE_GRACE`. `linger` when the peer should still read something (an ERROR, lines
    flushed on stop): half-close and wait for it to hang up too, discarding what it
    still sends, because closing with unread input resets the connection, which can
    destroy our last lines before the peer reads them. Never raises."""
    transport = writer.transport
    try:
        if not transport.is_closing():
            async with asyncio.timeout(_CLOSE_GRACE):
                if writer.can_write_eof():
                    writer.write_eof()
                if linger:
                    while await reader.read(1 << 16):
                        pass
                writer.close()
                await writer.wait_closed()
    except Exception as err:  # a timeout, or the connection failed: either way it is over
        log.debug("tcp: closing a connection: %r", err)
    finally:
        writer.close()
        transport.abort()  # a no-op once the connection is closed


def _check_options(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"tcp transport: {name} must be positive, got {value!r}")


def _check_secret(secret: str | None) -> bytes | None:
    if secret is None:
        return None
    if not isinstance(secret, str) or not secret:
        raise ConfigError(
            "tcp transport: replication.secret must be a non-empty string; leave it out to "
            "turn authentication off (the hub then listens on loopback only)"
        )
    return secret.encode()


def _proof(key: bytes, role: str, client: str, hub: str, hub_nonce: str, nonce: str) -> str:
    """What the `role` end ("client" or "hub") of the connection between `client` and
    `hub` shows to prove it holds the secret `key`. Names hold no spaces, nonces are hex:
    the message is unambiguous."""
    message = f"{_PROOF_LABEL} {role} {client} {hub} {hub_nonce} {nonce}"
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def _source_of(peer: object) -> str:
    """The address a connection came from, as its handshake slots and warnings are
    counted: the IP address, or for IPv6 its /64 (one host may own all of it)."""
    host = peer[0] if isinstance(peer, tuple) and peer else peer
    try:
        address = ipaddress.ip_address(str(host))
    except ValueError:
        return str(host)
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:  # an IPv4 peer of a dual-stack socket
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


def _clip(text: str) -> str:
    return text if len(text) <= _LOGGED_CHARS else text[:_LOGGED_CHARS] + "..."


@dataclass(slots=True)
class _Window:
    """Warnings about one address since the first one was logged."""

    timer: asyncio.TimerHandle
    since: float
    count: int = 0  # not logged yet
    last: str = ""


@dataclass
class _PeerLog:
    """Warnings about peers, one log line per `_LOG_INTERVAL` per peer address at most:
    the first at once; those after it within the interval are counted (each logged at
    DEBUG only) and summed up in one line when it ends. A peer that floods bad lines,
    or reconnects to fail its handshake over and over, cannot flood the log."""

    what: str  # "tcp hub", "tcp client"
    _windows: dict[str, _Window] = field(default_factory=dict)

    def warn(self, address: str, text: str) -> None:
        if address not in self._windows and len(self._windows) >= _MAX_LOGGED_ADDRESSES:
            address = "other addresses"
        window = self._windows.get(address)
        if window is None:
            log.warning("%s: %s: %s", self.what, address, text)
            self._open(address)
            return
        window.count += 1
        window.last = text
        log.debug("%s: %s: %s", self.what, address, text)

    def close(self) -> None:
        """Stop every timer, logging the counts not logged yet."""
        windows, self._windows = self._windows, {}
        for address, window in windows.items():
            window.timer.cancel()
            self._summary(address, window)

    def _open(self, address: str) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(_LOG_INTERVAL, self._end, address)
        self._windows[address] = _Window(timer, loop.time())

    def _end(self, address: str) -> None:
        window = self._windows.pop(address)
        if window.count:
            self._summary(address, window)
            self._open(address)  # the next line waits for the end of this window too

    def _summary(self, address: str, window: _Window) -> None:
        if window.count:
            log.warning(
                "%s: %s: %d more in the last %.1fs; the last: %s",
                self.what,
                address,
                window.count,
                asyncio.get_running_loop().time() - window.since,
                window.last,
            )


@dataclass(frozen=True, slots=True)
class _Options:
    """What every connection of the hub and of a client is run with."""

    ping_interval: float
    dead_after: float
    send_queue: int

    def __post_init__(self) -> None:
        _check_options(
            ping_interval=self.ping_interval,
            dead_after=self.dead_after,
            send_queue=self.send_queue,
        )


class _Budget:
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


# What a line received is handed to: the session's `received`, or the hub's relay.
_Deliver = Callable[[str | bytes], None]
# The hub's hook in `send`: True when it took the line, to send it a moment later.
_Hold = Callable[["_Connection", str], bool]
# Where warnings about a peer go (a `_PeerLog`, with the peer's address).
_Complain = Callable[[str], None]
# Counts what the hub refused, by reason (the `plait_tcp_hub_refused` metric).
_Refused = Callable[[str], None]


class _Connection:
    """One established connection, and the `Link` the handler sends through: reads lines,
    drains a bounded send queue with a writer task, pings, and closes a silent peer.
    `run` serves it until it ends; the owner then tells its session and calls `aclose`."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        name: str,
        label: str,
        options: _Options,
        complain: _Complain,
        hold: _Hold | None = None,
        refused: _Refused | None = None,
    ) -> None:
        self.name = name  # the peer's instance name (the hub's: "hub")
        self._reader = reader
        self._writer = writer
        self._label = label
        self._complain = complain
        self._ping_interval = options.ping_interval
        self._dead_after = options.dead_after
        self._send_queue = options.send_queue
        self._hold = hold
        self._queue: list[str] = []
        self._queued_bytes = 0  # about: characters, plus one per line break
        self._queued = asyncio.Event()
        self._ended = asyncio.Event()
        self._reason = ""
        self._flush = False
        self._linger = False  # the peer should still read what was written (ERROR)
        self._draining = False  # the writer waits for the peer to read
        self._last_received = asyncio.get_running_loop().time()
        # The hub is strict with its clients: it counts their bad lines, and closes them
        # past the budget.
        self._refused = refused
        self._bad_lines = _Budget(_BAD_LINES_BURST, _BAD_LINES_PER_SECOND, self._last_received)
        self.replicates = 0  # REPLICATEs received (the hub counts them)

    @property
    def label(self) -> str:
        return self._label

    def buffered_bytes(self) -> int:
        """About how many bytes are held for this peer: queued lines, bytes written but
        not sent yet, bytes received but not read as lines yet."""
        unsent = self._writer.transport.get_write_buffer_size()
        unread = len(getattr(self._reader, "_buffer", b""))  # StreamReader has no public size
        return self._queued_bytes + unsent + unread

    def send(self, line: str) -> None:
        """Queue a line; never blocks nor raises (see `Link.send`)."""
        if self._ended.is_set():
            return
        if self._hold is not None and self._hold(self, line):
            return
        if "\n" in line or "\r" in line:
            # A caller's bug; sent as is it would split into two commands on the wire.
            log.error("%s: not sending a line with a line break in it: %.80r", self._label, line)
            return
        if command_name(line) == Error.NAME:  # the answer to a bad line of the peer's
            self._complain(f"{self._label} sent a bad line: {_clip(line[len(Error.NAME) + 1 :])}")
        size = len(line) + 1
        # Held for this peer: queued here and written but not sent yet.
        held = self._queued_bytes + self._writer.transport.get_write_buffer_size() + size
        over_bytes = held > _MAX_BUFFERED_BYTES
        if over_bytes or len(self._queue) >= self._send_queue:
            if not over_bytes and not self._draining:
                # The peer keeps up; only our writer task has not run yet (a burst sent
                # in one go). Hand the lines to the socket now rather than drop the peer.
                self._queue.append(line)
                self._write_now(self._queue)
                self._queue.clear()
                self._queued_bytes = 0
                return
            limit = (
                f"{_MAX_BUFFERED_BYTES >> 20} MiB" if over_bytes else f"{self._send_queue} lines"
            )
            text = f"send queue full ({limit}): closing; reconnect and catch up"
            self._write_error(text)
            self._end("send queue full")
            return
        self._queue.append(line)
        self._queued_bytes += size
        self._queued.set()

    def bad_line(self, reason: str = "bad") -> None:
        """The peer sent a line it should not have. At the hub: counted under `reason`,
        and one off its budget (a burst of `_BAD_LINES_BURST`, then
        `_BAD_LINES_PER_SECOND`); past it, ERROR and close."""
        if self._refused is None:
            return
        self._refused(reason)
        if self._bad_lines.take(asyncio.get_running_loop().time()):
            return
        text = (
            f"too many bad lines (over {_BAD_LINES_BURST}, then "
            f"{_BAD_LINES_PER_SECOND:g} a second): closing; check this peer's version and "
            "configuration"
        )
        self._write_error(text)
        self._end("sent too many bad lines")

    def replace(self) -> None:
        """A newer connection took this one's name: ERROR, and close."""
        self._write_error(f"replaced by a newer connection named {self.name}", warn=False)
        self._end("replaced by a newer connection")

    def close(self) -> None:
        """Drop the connection at the handler's request (see `Link.close`)."""
        self._end("closed by the handler")

    def _end(self, reason: str, *, flush: bool = False) -> None:
        """End the connection (only the first call counts). Queued lines are dropped
        unless `flush`, when `aclose` still writes them."""
        if self._ended.is_set():
            return
        self._reason = reason
        self._flush = flush
        if not flush:
            self._queue.clear()
            self._queued_bytes = 0
        self._ended.set()

    async def run(
        self,
        session: Session,
        *,
        deliver: _Deliver | None = None,
        on_up: Callable[[], None] | None = None,
    ) -> str:
        """Serve until the connection ends, and return why. Every line received that is
        not the transport's own goes to `deliver` (default: `session.received`); `on_up`
        is called once `session.wait_up()` returns. Every task started here has ended on
        return; being cancelled (stop) closes the connection, keeping queued lines."""
        loop = asyncio.get_running_loop()
        to = session.received if deliver is None else deliver
        tasks = [
            loop.create_task(self._read_loop(to), name=f"{self._label} reader"),
            loop.create_task(self._write_loop(), name=f"{self._label} writer"),
            loop.create_task(self._keepalive(), name=f"{self._label} pings"),
        ]
        if on_up is not None:
            tasks.append(loop.create_task(self._watch_up(session, on_up), name=f"{self._label} up"))
        try:
            await self._ended.wait()
        except asyncio.CancelledError:
            self._end("stopping", flush=True)
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return self._reason

    async def aclose(self) -> None:
        """Write what is left to flush, then hang up (see `_close_stream`)."""
        if self._flush and self._queue:
            self._write_now(self._queue)
        self._queue.clear()
        self._queued_bytes = 0
        await _close_stream(self._reader, self._writer, linger=self._linger or self._flush)

    def _write_error(self, text: str, *, warn: bool = True) -> None:
        """Write ERROR past the queue, just before closing."""
        if warn:
            self._complain(f"{self._label}: {text}")
        self._linger = True
        self._write_now([to_line(Error(text))])

    def _write_now(self, lines: list[str]) -> None:
        if not self._writer.transport.is_closing():
            self._writer.write(_encode(lines))

    async def _read_loop(self, deliver: _Deliver) -> None:
        loop = asyncio.get_running_loop()
        count = 0
        try:
            while not self._ended.is_set():  # ended by a line: read no further
                raw = await _read_line(self._reader)
                if self._ended.is_set():  # ended while we waited: e.g. replaced, take nothing
                    break
                self._last_received = loop.time()
                self._dispatch(raw, deliver)
                count += 1
                if count % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        except asyncio.IncompleteReadError as err:
            self._end("the peer hung up" + (" in the middle of a line" if err.partial else ""))
        except _LineTooLongError:
            self._write_error(_LINE_TOO_LONG)
            self._end(f"the peer sent a {_LINE_TOO_LONG}")
        except Exception as err:  # OSError mostly; whatever it is, the connection is done
            self._end(f"read failed: {err!r}")

    def _dispatch(self, raw: bytes, deliver: _Deliver) -> None:
        """Route one received line. Never raises: one bad line must not end the loop."""
        try:
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                deliver(raw)  # as bytes: the session answers ERROR
                return
            name = command_name(text)
            if name == Error.NAME:  # it answers one line of ours: for the log only
                self._complain(f"{self._label} says: {_clip(text[len(name) + 1 :])}")
                return
            if name in CONNECTION_COMMANDS:
                if name != Ping.NAME:  # a ping only proves liveness, noted by the caller
                    log.debug("%s: ignoring %.80s", self._label, text)
                    self.bad_line()  # a handshake command again: the handshake is over
                return
            deliver(text)
        except Exception:
            log.exception("%s: handling a received line failed", self._label)

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._queued.wait()
                self._queued.clear()
                batch, self._queue = self._queue, []
                self._queued_bytes = 0
                if batch:
                    self._writer.write(_encode(batch))
                    # A peer that does not read leaves us waiting here (its window and
                    # our buffers full): only then does a full queue mean it is too slow.
                    self._draining = True
                    try:
                        async with asyncio.timeout(self._dead_after):
                            await self._writer.drain()
                    finally:
                        self._draining = False
        except Exception as err:  # the connection failed under us
            self._end(f"write failed: {err!r}")

    async def _keepalive(self) -> None:
        """Ping every `ping_interval`; close once nothing arrived for `dead_after`."""
        loop = asyncio.get_running_loop()
        next_ping = loop.time() + self._ping_interval
        while True:
            now = loop.time()
            silent = now - self._last_received
            if silent >= self._dead_after:
                self._end(f"nothing received for {silent:.1f}s")
                return
            if now >= next_ping:
                self.send(to_line(Ping(int(time.time() * 1000))))
                next_ping = now + self._ping_interval
            await asyncio.sleep(min(next_ping, self._last_received + self._dead_after) - now)

    async def _watch_up(self, session: Session, on_up: Callable[[], None]) -> None:
        try:
            await session.wait_up()
            on_up()
        except Exception:
            log.exception("%s: waiting for the connection to come up failed", self._label)


def _tell_closed(session: Session, label: str) -> None:
    try:
        session.closed()
    except Exception:
        log.exception("%s: the session failed to close", label)


class _HandshakeFailed(Exception):
    """The handshake failed: `text` says why (to the peer, in ERROR, and to the log);
    `reason` is how the hub counts it."""

    def __init__(self, text: str, reason: str = "handshake") -> None:
        super().__init__(text)
        self.text = text
        self.reason = reason


class _TellHub(Exception):
    """The client's handshake failed because the secrets are set differently: `text`
    for its own log, `to_hub` for the hub's (in ERROR)."""

    def __init__(self, text: str, to_hub: str) -> None:
        super().__init__(text)
        self.text = text
        self.to_hub = to_hub


async def _next_command(reader: asyncio.StreamReader, expecting: str) -> Command:
    """The next handshake line, parsed; `_HandshakeFailed` when it is malformed."""
    raw = await _read_line(reader)
    try:
        return _HANDSHAKE_COMMANDS.parse(raw)
    except CommandParseError as err:
        raise _HandshakeFailed(f"expected {expecting}: {err}") from None


def _field(line: str, index: int) -> str | None:
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


class TcpHub:
    """Accepts clients and relays commands between them; this instance's handler serves
    each client connection as it would any other. With a `secret`, clients must prove
    they hold it (and the hub proves it to them); without one, the hub listens on a
    loopback address only. `stop()` closes every connection and ends every task the
    hub started."""

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ping_interval: float = defaults.TCP_PING_INTERVAL,
        dead_after: float = defaults.TCP_DEAD_AFTER,
        send_queue: int = defaults.TCP_SEND_QUEUE,
        handshake_timeout: float = defaults.TCP_HANDSHAKE_TIMEOUT,
        secret: str | None = None,
        metrics: ReplicationMetrics | None = None,
    ) -> None:
        self._options = _Options(ping_interval, dead_after, send_queue)
        _check_options(handshake_timeout=handshake_timeout)
        self._handler = handler
        self._host = host
        self._port = port
        self._handshake_timeout = handshake_timeout
        self._secret = _check_secret(secret)
        self._metrics = metrics
        self._server: asyncio.Server | None = None
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()  # one per accepted connection
        self._peers: set[_Connection] = set()  # past the handshake: the relay set
        self._handshaking = 0  # connections accepted and not past the handshake yet
        self._handshaking_from: dict[str, int] = {}  # the same, by source address
        self._log = _PeerLog("tcp hub")
        # While our session takes a client's line: what the handler sends meanwhile,
        # to go out after the relay of that line (see `_deliver`).
        self._held: list[tuple[_Connection, str]] | None = None

    @property
    def port(self) -> int:
        """The port listened on (the bound one when started with port 0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("TcpHub: not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def buffered_bytes(self) -> int:
        """Bytes held for the connected peers (see `_Connection.buffered_bytes`)."""
        return sum(peer.buffered_bytes() for peer in self._peers)

    async def start(self) -> None:
        """Bind and listen; returns once clients can connect. Without a secret only a
        loopback address is allowed: whoever reaches the hub could speak for any
        instance."""
        if self._server is not None:
            raise RuntimeError("TcpHub: already started")
        if self._secret is None and not is_loopback(self._host):
            raise ConfigError(
                f"the TCP hub would listen on {self._host!r} without a secret, so anyone "
                "who reaches it could send rows and positions in any instance's name: "
                "set replication.secret (the same on every instance), or listen on "
                "127.0.0.1"
            )
        self._stopping = False
        # A task cancelled by stop() before it ran never counted down.
        self._handshaking = 0
        self._handshaking_from.clear()
        self._server = await asyncio.start_server(
            self._accept, self._host, self._port, limit=_READ_LIMIT, backlog=_BACKLOG
        )
        if self._metrics is not None:
            self._metrics.hub_buffered_bytes.set_function(self.buffered_bytes)
        name = self._handler.instance_name
        auth = "clients prove replication.secret" if self._secret else "no secret: loopback only"
        log.info("tcp hub %s: listening on %s:%d (%s)", name, self._host, self.port, auth)

    async def stop(self) -> None:
        """Stop listening, close every connection (flushing what is queued, each given at
        most `_CLOSE_GRACE` seconds) and end every task; sessions see `closed()`."""
        self._stopping = True
        server, self._server = self._server, None
        if server is not None:
            server.close()  # no new connections
        await cancel_and_wait(*self._tasks)
        if server is not None:
            # Only now: from Python 3.12 on this waits for every connection to close.
            await server.wait_closed()
        self._log.close()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Called by the server for every new connection. A plain function, not a
        # coroutine, so that the task serving the connection is ours to end in stop().
        if self._stopping:
            writer.transport.abort()
            return
        peer = writer.get_extra_info("peername")
        source = _source_of(peer)
        waiting = self._handshaking_from.get(source, 0)
        if waiting >= _MAX_HANDSHAKING_PER_ADDRESS:
            text = "too many connections from your address in the handshake; try again later"
        elif self._handshaking >= _MAX_HANDSHAKING:
            text = "too many connections in the handshake; try again later"
        else:
            # Counted here, not in the task: a burst is accepted before it runs.
            self._handshaking += 1
            self._handshaking_from[source] = waiting + 1
            task = asyncio.get_running_loop().create_task(
                self._serve(reader, writer, peer, source), name=f"tcp hub: client {peer}"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._count("busy")
        self._log.warn(source, f"refusing a connection: {text}")
        writer.write(_encode([to_line(Error(text))]))
        writer.close()  # after the ERROR is written; no task needed

    async def _serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: object,
        source: str,
    ) -> None:
        conn: _Connection | None = None
        refused = False
        try:
            try:
                name = await self._handshake(reader, writer, source)
            finally:
                self._handshaking -= 1
                if self._handshaking_from[source] > 1:
                    self._handshaking_from[source] -= 1
                else:
                    del self._handshaking_from[source]
            if name is None:
                refused = True
                return
            conn = _Connection(
                reader,
                writer,
                name=name,
                label=f"tcp:{name}",
                options=self._options,
                complain=functools.partial(self._log.warn, source),
                hold=self._hold,
                refused=self._count,
            )
            # One connection per name: the newer one is the instance that reconnected
            # (with a secret, it proved it holds it; without one, anyone local could
            # take any name anyway). The older one takes no line from here on.
            for old in [p for p in self._peers if p.name == name]:
                log.info(
                    "tcp hub: %s connected again from %s: closing its older connection", name, peer
                )
                old.replace()
            # With the secret, every line on it is a proven peer's, in its own name
            # (the hub checks the name of each; a client's lines come through the hub).
            session = self._handler.open(
                conn, reply_errors=True, authenticated=self._secret is not None
            )
            self._peers.add(conn)
            log.info("tcp hub: %s connected from %s", name, peer)
            try:
                reason = await conn.run(
                    session,
                    deliver=functools.partial(self._deliver, conn, session),
                    on_up=functools.partial(self._connection_up, conn),
                )
                log.info("tcp hub: %s disconnected: %s", name, reason)
            finally:
                self._peers.discard(conn)
                _tell_closed(session, conn.label)
                self._connection_down(conn)
        except Exception:
            log.exception("tcp hub: the connection from %s failed", peer)
        finally:
            if conn is not None:
                await conn.aclose()
            else:  # a refused peer should still read its ERROR
                await _close_stream(reader, writer, linger=refused)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: str
    ) -> str | None:
        """The client's name once the handshake succeeded; None once it failed (the
        client answered ERROR, unless it hung up or gave up itself)."""
        expecting = "NAME <name>"
        name: str | None = None
        try:
            async with asyncio.timeout(self._handshake_timeout):
                command = await _next_command(reader, f"{expecting} first")
                if not isinstance(command, Name):
                    raise _HandshakeFailed(f"expected {expecting} first, got {command.NAME}")
                name = command.name
                return await self._authenticate(reader, writer, name)
        except TimeoutError:
            failure = _HandshakeFailed(
                f"expected {self._expecting(name)} within {self._handshake_timeout:g}s"
            )
        except _LineTooLongError:
            failure = _HandshakeFailed(_LINE_TOO_LONG)
        except (asyncio.IncompleteReadError, OSError) as err:
            log.debug("tcp hub: %s hung up in the handshake: %r", source, err)
            return None
        except _HandshakeFailed as err:
            failure = err
        challenged = name is not None and self._secret is not None
        # Once challenged, whatever the client sends but its proof fails to prove it.
        self._count("auth" if challenged and failure.reason == "handshake" else failure.reason)
        who = "a connection" if name is None else name
        self._log.warn(source, f"refusing {who}: {failure.text}")
        writer.write(_encode([to_line(Error(failure.text))]))
        return None

    def _expecting(self, name: str | None) -> str:
        """What a client that said NAME `name` (None: not yet) is to send next."""
        if name is None or self._secret is None:
            return "NAME <name>"
        return "PROOF <nonce> <proof>"

    async def _authenticate(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str
    ) -> str:
        """Past NAME: `name` once the client proved it holds the secret (at once when
        there is none) and got SERVER; else `_HandshakeFailed`."""
        hub = self._handler.instance_name
        if name == hub:
            raise _HandshakeFailed(
                f"NAME {hub} is the hub's own name: name every instance differently", "name"
            )
        if self._secret is None:
            writer.write(_encode([to_line(Server(hub))]))
            return name
        hub_nonce = secrets.token_hex(_NONCE_BYTES)
        writer.write(_encode([to_line(Challenge(hub, hub_nonce))]))
        expecting = self._expecting(name)
        command = await _next_command(reader, expecting)
        if isinstance(command, Error):  # a client without the secret says so
            raise _HandshakeFailed(f"it gave up: {_clip(command.text)}", "auth")
        if not isinstance(command, Proof):
            raise _HandshakeFailed(f"expected {expecting}, got {command.NAME}")
        expected = _proof(self._secret, "client", name, hub, hub_nonce, command.nonce)
        if not hmac.compare_digest(expected, command.proof):
            raise _HandshakeFailed(
                "authentication failed: the proof does not match this hub's "
                f"replication.secret; {_SAME_SECRET}",
                "auth",
            )
        ours = _proof(self._secret, "hub", name, hub, hub_nonce, command.nonce)
        writer.write(_encode([to_line(Server(hub, ours))]))
        return name

    def _deliver(self, sender: _Connection, session: Session, line: str | bytes) -> None:
        """Give a client's line to our session, then relay it to every other client unless
        the session answered it with ERROR; what the handler sent meanwhile goes out after
        the relay. Lines in another instance's name are refused before either; they,
        bad lines and surplus REPLICATEs (dropped) draw on the sender's budget."""
        name = command_name(line) if isinstance(line, str) else ""
        refusal = self._impersonation(sender, name, line) if isinstance(line, str) else None
        if refusal is not None:
            sender.send(to_line(Error(refusal)))
            sender.bad_line("impersonation")
            return
        if name == Replicate.NAME:
            sender.replicates += 1
            if sender.replicates > _REPLICATE_FREE:  # a flood: dropped unanswered
                sender.bad_line()
                return
        held: list[tuple[_Connection, str]] = []
        self._held = held
        try:
            session.received(line)
        except Exception:  # the session promises not to raise: a bug
            log.exception("%s: the session failed on a line", sender.label)
        finally:
            self._held = None
        if isinstance(line, bytes) or not COMMAND_NAME.fullmatch(name):
            refused = True  # not UTF-8, or no command could have this name
        elif name in _BUILTIN_NAMES:
            refused = any(conn is sender and command_name(out) == Error.NAME for conn, out in held)
        else:
            refused = False  # an application's command, maybe unknown here: not ours to judge
        if refused:
            sender.bad_line()
        if isinstance(line, str) and not refused:
            for peer in self._peers:
                if peer is not sender:
                    peer.send(line)
        for conn, out in held:
            conn.send(out)

    def _impersonation(self, sender: _Connection, name: str, line: str) -> str | None:
        """Why `sender` may not send `line` (a row, position or departure in another
        instance's name), or None. A line without the name is left to the session."""
        hub = self._handler.instance_name
        if rows_of(line, hub):  # our session drops these unread, as its own echoes
            return f"{name} of {hub} refused: only {hub} sends its own (two instances named so?)"
        if name in (Rdata.NAME, Position.NAME):
            writer = _field(line, 2)
            if writer is None or writer == sender.name:
                return None
            if name == Rdata.NAME:
                return (
                    f"RDATA of {writer} refused: this connection is {sender.name}, and only "
                    f"{writer} sends its own rows"
                )
            return (
                f"POSITION of {writer} refused: this connection is {sender.name}, and only "
                f"{writer} sends its own (a fence of another writer goes as FENCED, which "
                "receivers check against the database)"
            )
        if name == Depart.NAME:
            departing = _field(line, 1)
            if departing is not None and departing != sender.name:
                return (
                    f"DEPART of {departing} refused: this connection is {sender.name}, and "
                    f"only {departing} departs"
                )
        return None

    def _hold(self, conn: _Connection, line: str) -> bool:
        if self._held is None:
            return False
        self._held.append((conn, line))
        return True

    def _count(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.child(self._metrics.tcp_hub_refused, reason).inc()

    def _connection_up(self, conn: _Connection) -> None:
        log.info("tcp hub: %s is up (every stream caught up)", conn.label)
        if self._metrics is not None:
            self._metrics.connection_up.labels(link=conn.label).set(1)

    def _connection_down(self, conn: _Connection) -> None:
        # A client that reconnected before its old connection was found dead has the
        # same label: its gauge belongs to the newer connection.
        if self._metrics is not None and all(p.label != conn.label for p in self._peers):
            self._metrics.connection_up.labels(link=conn.label).set(0)


class TcpClient:
    """Keeps one connection to a hub, reconnecting with backoff forever until `stop()`.
    The backoff starts over only once the handler's session says every stream caught up
    (R-RP-3), so a connection that fails before that never reconnects in a tight loop.
    With a `secret` it proves it holds it, and opens only once the hub proved it too."""

    def __init__(
        self,
        handler: Handler,
        *,
        host: str,
        port: int,
        ping_interval: float = defaults.TCP_PING_INTERVAL,
        dead_after: float = defaults.TCP_DEAD_AFTER,
        send_queue: int = defaults.TCP_SEND_QUEUE,
        connect_timeout: float = defaults.TCP_CONNECT_TIMEOUT,
        secret: str | None = None,
        backoff: Backoff | None = None,
        metrics: ReplicationMetrics | None = None,
    ) -> None:
        self._options = _Options(ping_interval, dead_after, send_queue)
        _check_options(connect_timeout=connect_timeout)
        self._handler = handler
        self._host = host
        self._port = port
        self._connect_timeout = connect_timeout
        self._secret = _check_secret(secret)
        self._backoff = backoff if backoff is not None else Backoff()
        self._metrics = metrics
        self._task: asyncio.Task[None] | None = None
        self._open = asyncio.Event()
        self._log = _PeerLog("tcp client")

    @property
    def label(self) -> str:
        return "tcp:hub"

    async def start(self) -> None:
        """Start connecting in the background; returns at once."""
        if self._task is not None:
            raise RuntimeError("TcpClient: already started")
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"tcp client of {self._host}:{self._port}"
        )

    async def stop(self) -> None:
        """Close the connection (flushing what is queued) and end every task."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        self._log.close()

    async def wait_open(self, timeout: float) -> bool:  # noqa: ASYNC109 (a deadline for one wait)
        """Whether a connection is open (handshake done, session opened) within `timeout`."""
        return await wait_set(self._open, timeout)

    async def _run(self) -> None:
        while True:
            try:
                reason = await self._attempt()
            except Exception as err:  # a bug or an odd failure: never end the loop over it
                log.exception("tcp client: hub %s:%d: connection failed", self._host, self._port)
                reason = f"failed: {err!r}"
            first = not self._backoff.failures_pending  # the first failure since up
            delay = self._backoff.next_delay()
            log.log(
                logging.WARNING if first else logging.DEBUG,
                "tcp client: hub %s:%d: %s; reconnecting in %.2fs",
                self._host,
                self._port,
                reason,
                delay,
            )
            await asyncio.sleep(delay)
            if self._metrics is not None:
                self._metrics.reconnects.labels(link=self.label).inc()

    async def _attempt(self) -> str:
        """One connection, from connecting to hanging up; returns why it ended."""
        try:
            async with asyncio.timeout(self._connect_timeout):
                reader, writer = await asyncio.open_connection(
                    self._host, self._port, limit=_READ_LIMIT
                )
        except TimeoutError:
            return f"no connection within {self._connect_timeout:g}s"
        except OSError as err:
            return f"cannot connect: {err}"
        conn: _Connection | None = None
        told = False  # we sent the hub ERROR: it should read it before we hang up
        try:
            writer.write(_encode([to_line(Name(self._handler.instance_name))]))
            try:
                hub = await self._handshake(reader, writer)
            except _HandshakeFailed as err:
                return err.text
            except _TellHub as err:
                writer.write(_encode([to_line(Error(err.to_hub))]))
                told = True
                return err.text
            log.info("tcp client: connected to hub %s at %s:%d", hub, self._host, self._port)
            conn = _Connection(
                reader,
                writer,
                name="hub",
                label=self.label,
                options=self._options,
                complain=functools.partial(self._log.warn, f"hub {self._host}:{self._port}"),
            )
            # With the secret, every line on it is a proven peer's, in its own name
            # (the hub checks the name of each; a client's lines come through the hub).
            session = self._handler.open(
                conn, reply_errors=True, authenticated=self._secret is not None
            )
            self._open.set()
            try:
                return await conn.run(session, on_up=self._connection_up)
            finally:
                self._open.clear()
                _tell_closed(session, self.label)
                if self._metrics is not None:
                    self._metrics.connection_up.labels(link=self.label).set(0)
        except Exception as err:
            log.exception("tcp client: the connection to the hub failed")
            return f"failed: {err!r}"
        finally:
            if conn is not None:
                await conn.aclose()
            else:
                await _close_stream(reader, writer, linger=told)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        """The hub's name once it said SERVER (and, with a secret, proved it holds it).
        Else `_HandshakeFailed` (the hub's fault or the network's) or `_TellHub` (say
        why to the hub too: the secrets are set differently)."""
        try:
            async with asyncio.timeout(self._connect_timeout):
                command = await self._next(reader, "SERVER or CHALLENGE")
                if isinstance(command, Challenge):
                    return await self._prove(reader, writer, command)
                if not isinstance(command, Server):
                    raise _HandshakeFailed(
                        f"expected SERVER or CHALLENGE from the hub, got {command.NAME}"
                    )
                if self._secret is not None:
                    raise _TellHub(
                        f"the hub {command.name} did not ask for proof of the replication "
                        "secret: it has none, and this instance has one: "
                        f"{_SAME_SECRET}",
                        f"this instance ({self._handler.instance_name}) has a "
                        "replication.secret, and the hub did not ask for proof of it: "
                        f"{_SAME_SECRET}",
                    )
                if command.proof is not None:
                    raise _HandshakeFailed("the hub sent SERVER with a proof nobody asked for")
                return command.name
        except TimeoutError:
            raise _HandshakeFailed(
                f"the handshake with the hub did not finish within {self._connect_timeout:g}s"
            ) from None
        except _LineTooLongError:
            raise _HandshakeFailed("the hub sent a line over the limit") from None
        except asyncio.IncompleteReadError:
            raise _HandshakeFailed("the hub hung up during the handshake") from None
        except OSError as err:
            raise _HandshakeFailed(f"the handshake failed: {err}") from None

    async def _prove(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, challenge: Challenge
    ) -> str:
        """Answer the hub's challenge, then check its proof; the hub's name."""
        me, hub = self._handler.instance_name, challenge.name
        if self._secret is None:
            raise _TellHub(
                "the hub asks for proof of the replication secret and this instance has "
                "none: set replication.secret, the same on every instance",
                f"this instance ({me}) has no replication.secret, and the hub asks for "
                f"proof of it: {_SAME_SECRET}",
            )
        nonce = secrets.token_hex(_NONCE_BYTES)
        ours = _proof(self._secret, "client", me, hub, challenge.nonce, nonce)
        writer.write(_encode([to_line(Proof(nonce, ours))]))
        answer = await self._next(reader, "SERVER")
        if not isinstance(answer, Server):
            raise _HandshakeFailed(f"expected SERVER from the hub, got {answer.NAME}")
        theirs = _proof(self._secret, "hub", me, hub, challenge.nonce, nonce)
        if (
            answer.name != hub
            or answer.proof is None
            or not hmac.compare_digest(theirs, answer.proof)
        ):
            text = (
                "the hub's proof does not match this instance's replication.secret: the "
                f"secrets differ, or this is not the hub; {_SAME_SECRET}"
            )
            raise _TellHub(text, text)
        return hub

    async def _next(self, reader: asyncio.StreamReader, expecting: str) -> Command:
        command = await _next_command(reader, f"{expecting} from the hub")
        if isinstance(command, Error):
            raise _HandshakeFailed(f"the hub refused the connection: {command.text}")
        return command

    def _connection_up(self) -> None:
        log.info("tcp client: the connection to the hub is up (every stream caught up)")
        self._backoff.up()
        if self._metrics is not None:
            self._metrics.connection_up.labels(link=self.label).set(1)
