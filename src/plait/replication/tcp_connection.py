"""One established TCP replication connection (`Connection`): its lines in, its bounded
send queue out, its pings, and how it closes; and the rate-limited log of what peers
did wrong (`PeerLog`). The rules are in `tcp_transport`'s docstring and
`plait.core.tcp_protocol`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from plait.core.commands import Error, Ping, command_name, to_line
from plait.core.tcp_protocol import (
    LINE_TOO_LONG,
    TOO_MANY_BAD_LINES,
    ClientLines,
    Keepalive,
    LineFramer,
    Route,
    clip,
    encode,
    route,
)
from plait.replication.link import Session
from plait.replication.tcp_options import TcpOptions

log = logging.getLogger(__name__)

# Bytes asked of the stream reader at a time; the framer cuts them into lines (and
# holds a line of up to MAX_LINE_BYTES while it arrives).
_CHUNK = 1 << 16
# The stream reader's limit, which only sets its flow control (`Lines` never asks it for
# a line): it stops reading the socket once it holds 2 x READ_LIMIT bytes not read yet.
READ_LIMIT = _CHUNK
# How long a closing connection lets the peer read what was sent and hang up itself
# before the socket is cut (a peer that does not read would otherwise hold it forever).
CLOSE_GRACE = 1.0
# The reader lets the other tasks run after this many lines read back to back: a line
# already buffered is read without yielding, so one peer's flood would otherwise hold
# the event loop, and every other connection's reader, writer and pinger with it.
_YIELD_EVERY = 64
# Bytes held for one peer (queued lines and bytes not yet sent) past which it counts as
# too slow, whatever `send_queue` allows: lines can be up to MAX_LINE_BYTES each.
MAX_BUFFERED_BYTES = 64 << 20
# Warnings about one peer address: one log line per this many seconds at most.
LOG_INTERVAL = 10.0
# Peer addresses whose warnings are counted apart; past this many, the rest share one.
_MAX_LOGGED_ADDRESSES = 1024


class LineTooLongError(Exception):
    """The peer sent a line over MAX_LINE_BYTES."""


class PeerHungUpError(Exception):
    """The peer closed the connection; `mid_line`: with part of a line unsent."""

    def __init__(self, mid_line: bool) -> None:
        super().__init__("the peer hung up" + (" in the middle of a line" if mid_line else ""))
        self.mid_line = mid_line


class Lines:
    """A connection's received lines: bytes from the stream reader, cut by a
    `LineFramer` (which holds what the handshake read past its last line, too)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self._framer = LineFramer()

    async def next(self) -> bytes:
        """The next line without its ending. Raises `PeerHungUpError` at EOF,
        `LineTooLongError` for a line over the limit, `OSError` when the connection
        failed."""
        framer = self._framer
        while True:
            line = framer.pop()
            if line is not None:
                return line
            if framer.too_long:
                raise LineTooLongError
            data = await self.reader.read(_CHUNK)
            if not data:
                raise PeerHungUpError(mid_line=bool(framer.partial))
            framer.feed(data)

    @property
    def buffered(self) -> int:
        """Bytes received and not taken as lines yet, as far as they are known: the
        stream reader has no public size of what it holds, and holds at most about
        2 x READ_LIMIT (plus one socket read) before it stops reading the socket."""
        return self._framer.buffered


async def close_stream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, linger: bool
) -> None:
    """Hang up, flushing what was written; a peer that does not read is cut off after
    `CLOSE_GRACE`. `linger` when the peer should still read something (an ERROR, lines
    flushed on stop): half-close and wait for it to hang up too, discarding what it
    still sends, because closing with unread input resets the connection, which can
    destroy our last lines before the peer reads them. Never raises."""
    transport = writer.transport
    try:
        if not transport.is_closing():
            async with asyncio.timeout(CLOSE_GRACE):
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


@dataclass(slots=True)
class _Window:
    """Warnings about one address since the first one was logged."""

    timer: asyncio.TimerHandle
    since: float
    count: int = 0  # not logged yet
    last: str = ""


@dataclass
class PeerLog:
    """Warnings about peers, one log line per `LOG_INTERVAL` per peer address at most:
    the first at once; those after it within the interval are counted (each logged at
    DEBUG only) and summed up in one line when it ends. A peer that floods bad lines,
    or reconnects to fail its handshake over and over, cannot flood the log."""

    what: str  # "tcp hub", "tcp client"
    # Where the lines go: the hub's and the client's own logger (`tcp_transport`).
    logger: logging.Logger = log
    _windows: dict[str, _Window] = field(default_factory=dict)

    def warn(self, address: str, text: str) -> None:
        if address not in self._windows and len(self._windows) >= _MAX_LOGGED_ADDRESSES:
            address = "other addresses"
        window = self._windows.get(address)
        if window is None:
            self.logger.warning("%s: %s: %s", self.what, address, text)
            self._open(address)
            return
        window.count += 1
        window.last = text
        self.logger.debug("%s: %s: %s", self.what, address, text)

    def close(self) -> None:
        """Stop every timer, logging the counts not logged yet."""
        windows, self._windows = self._windows, {}
        for address, window in windows.items():
            window.timer.cancel()
            self._summary(address, window)

    def _open(self, address: str) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(LOG_INTERVAL, self._end, address)
        self._windows[address] = _Window(timer, loop.time())

    def _end(self, address: str) -> None:
        window = self._windows.pop(address)
        if window.count:
            self._summary(address, window)
            self._open(address)  # the next line waits for the end of this window too

    def _summary(self, address: str, window: _Window) -> None:
        if window.count:
            self.logger.warning(
                "%s: %s: %d more in the last %.1fs; the last: %s",
                self.what,
                address,
                window.count,
                asyncio.get_running_loop().time() - window.since,
                window.last,
            )


# What a line received is handed to: the session's `received`, or the hub's relay.
_Deliver = Callable[[str | bytes], None]
# The hub's hook in `send`: True when it took the line, to send it a moment later.
_Hold = Callable[["Connection", str], bool]
# Where warnings about a peer go (a `PeerLog`, with the peer's address).
_Complain = Callable[[str], None]
# Counts what the hub refused, by reason (the `plait_tcp_hub_refused` metric).
_Refused = Callable[[str], None]


class Connection:
    """One established connection, and the `Link` the handler sends through: reads lines,
    drains a bounded send queue with a writer task, pings, and closes a silent peer.
    `run` serves it until it ends; the owner then tells its session and calls `aclose`."""

    def __init__(
        self,
        lines: Lines,
        writer: asyncio.StreamWriter,
        *,
        name: str,
        label: str,
        options: TcpOptions,
        complain: _Complain,
        hold: _Hold | None = None,
        refused: _Refused | None = None,
        rules: ClientLines | None = None,
    ) -> None:
        self.name = name  # the peer's instance name (the hub's: "hub")
        self._lines = lines
        self._writer = writer
        self._label = label
        self._complain = complain
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
        now = asyncio.get_running_loop().time()
        self._alive = Keepalive(options.ping_interval, options.dead_after, now)
        # The hub is strict with its clients: it counts their bad lines, and closes them
        # past the budget (`rules`, the hub's for this client's lines).
        self._refused = refused
        self.rules = rules

    @property
    def label(self) -> str:
        return self._label

    def buffered_bytes(self) -> int:
        """About how many bytes are held for this peer: queued lines, bytes written but
        not sent yet, bytes received but not read as lines yet."""
        unsent = self._writer.transport.get_write_buffer_size()
        return self._queued_bytes + unsent + self._lines.buffered

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
            self._complain(f"{self._label} sent a bad line: {clip(line[len(Error.NAME) + 1 :])}")
        size = len(line) + 1
        # Held for this peer: queued here and written but not sent yet.
        held = self._queued_bytes + self._writer.transport.get_write_buffer_size() + size
        over_bytes = held > MAX_BUFFERED_BYTES
        if over_bytes or len(self._queue) >= self._send_queue:
            if not over_bytes and not self._draining:
                # The peer keeps up; only our writer task has not run yet (a burst sent
                # in one go). Hand the lines to the socket now rather than drop the peer.
                self._queue.append(line)
                self._write_now(self._queue)
                self._queue.clear()
                self._queued_bytes = 0
                return
            limit = f"{MAX_BUFFERED_BYTES >> 20} MiB" if over_bytes else f"{self._send_queue} lines"
            text = f"send queue full ({limit}): closing; reconnect and catch up"
            self._write_error(text)
            self._end("send queue full")
            return
        self._queue.append(line)
        self._queued_bytes += size
        self._queued.set()

    def bad_line(self, reason: str = "bad") -> None:
        """The peer sent a line it should not have. At the hub: counted under `reason`,
        and one off its budget (`ClientLines.bad`); past it, ERROR and close."""
        if self._refused is not None:
            self._refused(reason)
        if self.rules is None or not self.rules.bad(asyncio.get_running_loop().time()):
            return
        self._write_error(TOO_MANY_BAD_LINES)
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
        """Write what is left to flush, then hang up (see `close_stream`)."""
        if self._flush and self._queue:
            self._write_now(self._queue)
        self._queue.clear()
        self._queued_bytes = 0
        await close_stream(self._lines.reader, self._writer, linger=self._linger or self._flush)

    def _write_error(self, text: str, *, warn: bool = True) -> None:
        """Write ERROR past the queue, just before closing."""
        if warn:
            self._complain(f"{self._label}: {text}")
        self._linger = True
        self._write_now([to_line(Error(text))])

    def _write_now(self, lines: list[str]) -> None:
        if not self._writer.transport.is_closing():
            self._writer.write(encode(lines))

    async def _read_loop(self, deliver: _Deliver) -> None:
        loop = asyncio.get_running_loop()
        count = 0
        try:
            while not self._ended.is_set():  # ended by a line: read no further
                raw = await self._lines.next()
                if self._ended.is_set():  # ended while we waited: e.g. replaced, take nothing
                    break
                self._alive.received(loop.time())
                self._dispatch(raw, deliver)
                count += 1
                if count % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        except PeerHungUpError as err:
            self._end(str(err))
        except LineTooLongError:
            self._write_error(LINE_TOO_LONG)
            self._end(f"the peer sent a {LINE_TOO_LONG}")
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
            where = route(text)
            if where is Route.SESSION:
                deliver(text)
            elif where is Route.PEER_ERROR:  # it answers one line of ours: for the log only
                self._complain(f"{self._label} says: {clip(text[len(Error.NAME) + 1 :])}")
            elif where is Route.BAD:  # a handshake command again: the handshake is over
                log.debug("%s: ignoring %.80s", self._label, text)
                self.bad_line()
            # Route.PING only proves liveness, noted by the reader
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
                    self._writer.write(encode(batch))
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
        """Ping and close a silent peer as `Keepalive` decides."""
        loop = asyncio.get_running_loop()
        alive = self._alive
        while True:
            now = loop.time()
            ping, silent = alive.due(now)
            if silent is not None:
                self._end(f"nothing received for {silent:.1f}s")
                return
            if ping:
                self.send(to_line(Ping(int(time.time() * 1000))))
            await asyncio.sleep(alive.wake_at - now)

    async def _watch_up(self, session: Session, on_up: Callable[[], None]) -> None:
        try:
            await session.wait_up()
            on_up()
        except Exception:
            log.exception("%s: waiting for the connection to come up failed", self._label)


def tell_closed(session: Session, label: str) -> None:
    try:
        session.closed()
    except Exception:
        log.exception("%s: the session failed to close", label)
