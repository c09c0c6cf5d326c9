"""TCP replication transport: a hub on one instance, clients on the others (R-RP-1).

The rules this module keeps:
- Framing: a command is one UTF-8 line ending in "\\n" ("\\r\\n" is accepted) of at most
  MAX_LINE_BYTES; a longer line is answered with ERROR and the connection closes.
- Handshake: the client sends NAME, the hub answers SERVER; only then does either end
  call `Handler.open`. A hub that gets anything else first, or nothing within its
  handshake timeout, answers ERROR and closes.
- PING, NAME and SERVER belong to the transport: never relayed, never given to a session.
  The hub hands every other line from a client to its own session and relays it,
  verbatim, to every other client unless the session answered it with ERROR: a line
  that is not UTF-8, has no well-formed command name, or is a built-in command with bad
  arguments reaches no other peer. Application commands (other well-formed names) are
  relayed whatever the hub's session said, as the hub need not register them. The
  relay goes out before anything the hub's handler sent while taking the line, so all
  of them see the hub's order. ERROR is not relayed (it answers one peer).
- A hostile or broken client costs the others a bounded share: the hub's reader yields
  every `_YIELD_EVERY` lines (a flood must not starve the other connections); bad lines
  (those not relayed above, NAME or SERVER again, RDATA or POSITION in the hub's own
  name, REPLICATEs past the first few) draw on a budget of `_BAD_LINES_BURST` plus
  `_BAD_LINES_PER_SECOND`, past which the client gets ERROR and is closed; ERRORs it
  sends past a budget as large are dropped unseen; at most `_MAX_HANDSHAKING`
  connections wait in the handshake at once, more are refused on the spot.
- `Link.send` never waits: a connection queues at most `send_queue` lines (and
  `_MAX_BUFFERED_BYTES`) for its writer task. A peer too slow to keep up gets ERROR and
  is closed (it catches up after reconnecting); lines sent to a closed connection are
  dropped. With the reader's limit of two lines, what the hub holds for one peer stays
  bounded whatever it sends or fails to read.
- Each end sends PING every `ping_interval` and closes a peer silent for `dead_after`.
- Every task is owned: a connection's reader, writer, pinger and wait_up watcher end
  when it closes; the hub and the client end their connections in `stop()`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from plait.core.backoff import Backoff
from plait.core.commands import (
    BUILTIN,
    COMMAND_NAME,
    MAX_LINE_BYTES,
    CommandSet,
    Error,
    Name,
    Ping,
    Replicate,
    Server,
    rows_of,
    to_line,
)
from plait.errors import CommandParseError, ConfigError
from plait.replication.link import (
    CONNECTION_COMMANDS,
    Handler,
    Session,
    command_name,
    wait_set,
)
from plait.replication.metrics import ReplicationMetrics

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
# Connections in the handshake at once; more are refused on the spot, so that sockets
# that never send NAME cannot pile up (each is also cut at the handshake timeout).
_MAX_HANDSHAKING = 64
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


class _Connection:
    """One established connection, and the `Link` the handler sends through: reads lines,
    drains a bounded send queue with a writer task, pings, and closes a silent peer.
    `run` serves it until it ends; the owner then tells its session and calls `aclose`."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        label: str,
        options: _Options,
        hold: _Hold | None = None,
        strict: bool = False,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._label = label
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
        # The hub is strict with its clients: bad lines past the budget close them.
        self._strict = strict
        now = self._last_received
        self._bad_lines = _Budget(_BAD_LINES_BURST, _BAD_LINES_PER_SECOND, now)
        self._complaints = _Budget(_BAD_LINES_BURST, _BAD_LINES_PER_SECOND, now)
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
            log.warning("%s: %s", self._label, text)
            self._write_error(text)
            self._end("send queue full")
            return
        self._queue.append(line)
        self._queued_bytes += size
        self._queued.set()

    def bad_line(self) -> None:
        """The peer sent a line it should not have. When strict: one off its budget (a
        burst of `_BAD_LINES_BURST`, then `_BAD_LINES_PER_SECOND`); past it, ERROR and
        close."""
        if not self._strict or self._bad_lines.take(asyncio.get_running_loop().time()):
            return
        text = (
            f"too many bad lines (over {_BAD_LINES_BURST}, then "
            f"{_BAD_LINES_PER_SECOND:g} a second): closing; check this peer's version and "
            "configuration"
        )
        log.warning("%s: %s", self._label, text)
        self._write_error(text)
        self._end("sent too many bad lines")

    def may_complain(self) -> bool:
        """Whether an ERROR from the peer should still reach the session (and its log):
        as many as bad lines may be. An ERROR can answer a line of ours that was fine
        for us, so complaints never close the connection; past the budget they are
        dropped unseen."""
        return self._complaints.take(asyncio.get_running_loop().time())

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

    def _write_error(self, text: str) -> None:
        """Write ERROR past the queue, just before closing."""
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
            if name in CONNECTION_COMMANDS:
                if name != Ping.NAME:  # a ping only proves liveness, noted by the caller
                    log.debug("%s: ignoring %.80s", self._label, text)
                    self.bad_line()  # NAME or SERVER again: the handshake is over
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


class TcpHub:
    """Accepts clients and relays commands between them; this instance's handler serves
    each client connection as it would any other. `stop()` closes every connection and
    ends every task the hub started."""

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ping_interval: float = 5.0,
        dead_after: float = 25.0,
        send_queue: int = 10_000,
        handshake_timeout: float = 10.0,
        metrics: ReplicationMetrics | None = None,
    ) -> None:
        self._options = _Options(ping_interval, dead_after, send_queue)
        _check_options(handshake_timeout=handshake_timeout)
        self._handler = handler
        self._host = host
        self._port = port
        self._handshake_timeout = handshake_timeout
        self._metrics = metrics
        self._server: asyncio.Server | None = None
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()  # one per accepted connection
        self._peers: set[_Connection] = set()  # past the handshake: the relay set
        self._handshaking = 0  # connections accepted and not past the handshake yet
        self._refusing = False  # the last connection was refused for that
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
        """Bind and listen; returns once clients can connect."""
        if self._server is not None:
            raise RuntimeError("TcpHub: already started")
        self._stopping = False
        self._handshaking = 0  # a task cancelled by stop() before it ran never counted down
        self._server = await asyncio.start_server(
            self._accept, self._host, self._port, limit=_READ_LIMIT, backlog=_BACKLOG
        )
        if self._metrics is not None:
            self._metrics.hub_buffered_bytes.set_function(self.buffered_bytes)
        name = self._handler.instance_name
        log.info("tcp hub %s: listening on %s:%d", name, self._host, self.port)

    async def stop(self) -> None:
        """Stop listening, close every connection (flushing what is queued, each given at
        most `_CLOSE_GRACE` seconds) and end every task; sessions see `closed()`."""
        self._stopping = True
        server, self._server = self._server, None
        if server is not None:
            server.close()  # no new connections
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            # Only now: from Python 3.12 on this waits for every connection to close.
            await server.wait_closed()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Called by the server for every new connection. A plain function, not a
        # coroutine, so that the task serving the connection is ours to end in stop().
        if self._stopping:
            writer.transport.abort()
            return
        peer = writer.get_extra_info("peername")
        if self._handshaking >= _MAX_HANDSHAKING:
            # One warning per streak: a flood of connections is not a flood of logs.
            log.log(
                logging.DEBUG if self._refusing else logging.WARNING,
                "tcp hub: refusing %s: %d connections are in the handshake already",
                peer,
                self._handshaking,
            )
            self._refusing = True
            text = "too many connections in the handshake; try again later"
            writer.write(_encode([to_line(Error(text))]))
            writer.close()  # after the ERROR is written; no task needed
            return
        self._refusing = False
        self._handshaking += 1  # here, not in the task: a burst is accepted before it runs
        task = asyncio.get_running_loop().create_task(
            self._serve(reader, writer, peer), name=f"tcp hub: client {peer}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: object
    ) -> None:
        conn: _Connection | None = None
        refused = False
        try:
            try:
                name = await self._handshake(reader, writer, peer)
            finally:
                self._handshaking -= 1
            if name is None:
                refused = True
                return
            conn = _Connection(
                reader,
                writer,
                label=f"tcp:{name}",
                options=self._options,
                hold=self._hold,
                strict=True,
            )
            session = self._handler.open(conn, reply_errors=True)
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
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: object
    ) -> str | None:
        """The client's name once it sent NAME and got SERVER back; None once it was
        answered ERROR (or hung up)."""
        try:
            async with asyncio.timeout(self._handshake_timeout):
                raw = await _read_line(reader)
        except TimeoutError:
            problem = f"expected NAME <name> within {self._handshake_timeout:g}s"
        except _LineTooLongError:
            problem = _LINE_TOO_LONG
        except (asyncio.IncompleteReadError, OSError) as err:
            log.debug("tcp hub: %s hung up before NAME: %r", peer, err)
            return None
        else:
            try:
                command = _HANDSHAKE_COMMANDS.parse(raw)
            except CommandParseError as err:
                problem = f"expected NAME <name> first: {err}"
            else:
                if isinstance(command, Name):
                    writer.write(_encode([to_line(Server(self._handler.instance_name))]))
                    return command.name
                problem = f"expected NAME <name> first, got {command.NAME}"
        log.warning("tcp hub: refusing the connection from %s: %s", peer, problem)
        writer.write(_encode([to_line(Error(problem))]))
        return None

    def _deliver(self, sender: _Connection, session: Session, line: str | bytes) -> None:
        """Give a client's line to our session, then relay it to every other client unless
        the session answered it with ERROR; what the handler sent meanwhile goes out after
        the relay. Bad lines and surplus REPLICATEs (dropped) draw on the sender's budget;
        ERRORs past their own budget are dropped."""
        name = command_name(line) if isinstance(line, str) else ""
        if name == Error.NAME:  # answers one peer: never relayed
            if sender.may_complain():
                session.received(line)
            return
        if isinstance(line, str) and rows_of(line, self._handler.instance_name):
            # Our session drops these unread, as its own echoes; no client may send them.
            hub = self._handler.instance_name
            text = f"{name} of {hub} refused: only {hub} sends its own (two instances named so?)"
            sender.send(to_line(Error(text)))
            sender.bad_line()
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

    def _hold(self, conn: _Connection, line: str) -> bool:
        if self._held is None:
            return False
        self._held.append((conn, line))
        return True

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
    (R-RP-3), so a connection that fails before that never reconnects in a tight loop."""

    def __init__(
        self,
        handler: Handler,
        *,
        host: str,
        port: int,
        ping_interval: float = 5.0,
        dead_after: float = 25.0,
        send_queue: int = 10_000,
        connect_timeout: float = 5.0,
        backoff: Backoff | None = None,
        metrics: ReplicationMetrics | None = None,
    ) -> None:
        self._options = _Options(ping_interval, dead_after, send_queue)
        _check_options(connect_timeout=connect_timeout)
        self._handler = handler
        self._host = host
        self._port = port
        self._connect_timeout = connect_timeout
        self._backoff = backoff if backoff is not None else Backoff()
        self._metrics = metrics
        self._task: asyncio.Task[None] | None = None
        self._open = asyncio.Event()

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
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

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
        try:
            writer.write(_encode([to_line(Name(self._handler.instance_name))]))
            problem = await self._handshake(reader)
            if problem is not None:
                return problem
            conn = _Connection(
                reader,
                writer,
                label=self.label,
                options=self._options,
            )
            session = self._handler.open(conn, reply_errors=True)
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
                await _close_stream(reader, writer, linger=False)

    async def _handshake(self, reader: asyncio.StreamReader) -> str | None:
        """None once the hub answered SERVER, else what went wrong."""
        try:
            async with asyncio.timeout(self._connect_timeout):
                raw = await _read_line(reader)
        except TimeoutError:
            return f"no SERVER from the hub within {self._connect_timeout:g}s"
        except _LineTooLongError:
            return "the hub sent a line over the limit"
        except asyncio.IncompleteReadError:
            return "the hub hung up during the handshake"
        except OSError as err:
            return f"the handshake failed: {err}"
        try:
            command = _HANDSHAKE_COMMANDS.parse(raw)
        except CommandParseError as err:
            return f"expected SERVER from the hub: {err}"
        if isinstance(command, Error):
            return f"the hub refused the connection: {command.text}"
        if not isinstance(command, Server):
            return f"expected SERVER from the hub, got {command.NAME}"
        log.info("tcp client: connected to hub %s at %s:%d", command.name, self._host, self._port)
        return None

    def _connection_up(self) -> None:
        log.info("tcp client: the connection to the hub is up (every stream caught up)")
        self._backoff.up()
        if self._metrics is not None:
            self._metrics.connection_up.labels(link=self.label).set(1)
