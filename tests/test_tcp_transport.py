"""The TCP transport over real sockets on 127.0.0.1: handshake, relay order, pings and
dead peers, the send-queue limit, framing errors, reconnects with backoff, and that
stop() ends every task. The handler is a recording test double (the transport is under
test); misbehaving peers are bare sockets speaking the protocol by hand."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pace import scaled, slowness, within
from plait.core import tcp_protocol
from plait.core.backoff import Backoff
from plait.core.commands import MAX_LINE_BYTES, CommandSet, Depart, Position, Rdata, rows_of
from plait.errors import CommandParseError, ConfigError
from plait.replication import tcp_connection, tcp_transport
from plait.replication.link import Link
from plait.replication.metrics import ReplicationMetrics
from plait.replication.tcp_client import TcpClient
from plait.replication.tcp_options import TcpOptions
from plait.replication.tcp_transport import TcpHub
from transport_helpers import RecordingBackoff, eventually

HOST = "127.0.0.1"
WAIT = 3.0  # how long any one expected event may take before the test fails


# -- the test double: a handler that records -------------------------------------------


class RecordingSession:
    def __init__(self, handler: RecordingHandler, link: Link) -> None:
        self.handler = handler
        self.authenticated = False  # what the transport said when it opened the session
        self.link = link
        self.lines: list[str] = []
        self.closed_calls = 0

    def received(self, line: str | bytes) -> None:
        text = line.decode(errors="replace") if isinstance(line, bytes) else line
        self.lines.append(text)
        # As the real handler: a line it cannot parse is answered with ERROR, at once.
        if text.startswith(("RDATA bad", "APP_UNKNOWN")) or isinstance(line, bytes):
            self.link.send(f"ERROR cannot parse {text[:20]}")
        # As a listener that writes at once when it sees a row.
        if text.startswith("REACT "):
            self.handler.send_all(f"REACTION to {text}")

    async def wait_up(self) -> None:
        await self.handler.up.wait()
        self.handler.events.append(f"wait_up returned: {self.link.label}")

    def closed(self) -> None:
        self.closed_calls += 1
        self.handler.events.append(f"closed: {self.link.label}")

    def matching(self, prefix: str) -> list[str]:
        return [line for line in self.lines if line.startswith(prefix)]


class RecordingHandler:
    """Records what the transport does to it; `open` sends REPLICATE, as the real one
    does; `wait_up` returns once the test sets `up`."""

    def __init__(self, name: str, *, up: bool = True, events: list[str] | None = None) -> None:
        self.instance_name = name
        self.sessions: list[RecordingSession] = []
        self.up = asyncio.Event()
        if up:
            self.up.set()
        self.events = events if events is not None else []

    def open(
        self, link: Link, *, reply_errors: bool, authenticated: bool = False
    ) -> RecordingSession:
        assert reply_errors
        session = RecordingSession(self, link)
        session.authenticated = authenticated
        self.sessions.append(session)
        self.events.append(f"open: {link.label}")
        link.send("REPLICATE")
        return session

    def live(self) -> list[RecordingSession]:
        return [s for s in self.sessions if not s.closed_calls]

    def session_of(self, label: str) -> RecordingSession:
        (session,) = [s for s in self.live() if s.link.label == label]
        return session

    def send_all(self, line: str) -> None:
        """What the hub's handler does for its own commands: send through every link."""
        for session in self.live():
            session.link.send(line)


# -- helpers -----------------------------------------------------------------------------


def tcp_options(**options: Any) -> tuple[TcpOptions, dict[str, Any]]:
    """The transport's settings among `options` (a hub on any free port by default),
    and the rest (secret, backoff, metrics)."""
    settings = {k: options.pop(k) for k in list(options) if k in TcpOptions.model_fields}
    return TcpOptions(**{"host": HOST, "port": 0, **settings}), options


@asynccontextmanager
async def running_hub(handler: RecordingHandler, **options: Any) -> AsyncIterator[TcpHub]:
    settings, rest = tcp_options(**options)
    hub = TcpHub(handler, settings, **rest)
    await hub.start()
    try:
        yield hub
    finally:
        await hub.stop()


@asynccontextmanager
async def running_client(
    handler: RecordingHandler, port: int, **options: Any
) -> AsyncIterator[TcpClient]:
    settings, rest = tcp_options(port=port, **options)
    client = TcpClient(handler, settings, **rest)
    await client.start()
    try:
        yield client
    finally:
        await client.stop()


class RawPeer:
    """One end of a connection driven by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, port: int, source: str = HOST) -> RawPeer:
        """Connected from the loopback address `source` (any of 127/8)."""
        reader, writer = await asyncio.open_connection(
            HOST, port, limit=4 * MAX_LINE_BYTES, local_addr=(source, 0)
        )
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def line(self) -> str:
        async with within(WAIT, "a line from the other end"):
            raw = await self.reader.readline()
        assert raw.endswith(b"\n"), f"connection ended instead: {raw!r}"
        return raw.decode().rstrip("\n")

    async def rest(self) -> list[str]:
        """Every line until the other end hangs up."""
        async with within(WAIT, "the other end to hang up"):
            data = await self.reader.read()
        return data.decode().splitlines()

    async def handshake(self, name: str) -> None:
        await self.send(f"NAME {name}\n".encode())
        assert (await self.line()).startswith("SERVER ")

    async def close(self) -> None:
        self.writer.close()
        with suppress(OSError):
            await self.writer.wait_closed()


async def connected_trio(
    hub: TcpHub, hub_handler: RecordingHandler, other: RecordingHandler, name: str = "raw"
) -> RawPeer:
    """A raw peer `name` and a client of `other`, both past the handshake at the hub."""
    peer = await RawPeer.connect(hub.port)
    await peer.handshake(name)
    assert await peer.line() == "REPLICATE"
    await eventually(lambda: len(hub_handler.live()) == 2, "both at the hub")
    await eventually(lambda: len(other.sessions) == 1, "the other opened")
    return peer


class FakeHub:
    """A listening socket whose connections the test answers by hand."""

    def __init__(self) -> None:
        self.peers: asyncio.Queue[RawPeer] = asyncio.Queue()
        self.accepted: list[RawPeer] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> FakeHub:
        self.server = await asyncio.start_server(self._accept, HOST, 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for peer in self.accepted:
            await peer.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = RawPeer(reader, writer)
        self.accepted.append(peer)
        self.peers.put_nowait(peer)

    async def accept(self) -> RawPeer:
        async with within(WAIT, "a connection to the fake hub"):
            return await self.peers.get()


# -- 1. handshake ------------------------------------------------------------------------


async def test_hub_answers_name_with_server_then_opens_a_session() -> None:
    hub_handler = RecordingHandler("hub")
    async with running_hub(hub_handler) as hub:
        peer = await RawPeer.connect(hub.port)
        await asyncio.sleep(0.05)
        assert hub_handler.sessions == []  # nothing opens before NAME
        await peer.send(b"NAME raw\r\n")  # "\r\n" is accepted too
        assert await peer.line() == "SERVER hub"
        assert await peer.line() == "REPLICATE"  # the hub's handler opened, and sent
        assert [s.link.label for s in hub_handler.sessions] == ["tcp:raw"]
        await peer.send(b"REPLICATE\r\n")
        await eventually(lambda: hub_handler.sessions[0].lines == ["REPLICATE"], "hub got it")
        await peer.close()
        await eventually(lambda: hub_handler.sessions[0].closed_calls == 1, "session closed")


async def test_client_sends_name_and_opens_only_after_server() -> None:
    handler = RecordingHandler("c1")
    async with FakeHub() as fake, running_client(handler, fake.port) as client:
        assert client.label == "tcp:hub"
        hub_end = await fake.accept()
        assert await hub_end.line() == "NAME c1"
        await asyncio.sleep(0.05)
        assert handler.sessions == []
        assert not await client.wait_open(0.01)
        await hub_end.send(b"SERVER fake\n")
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        assert await hub_end.line() == "REPLICATE"  # the client's handler opened, and sent
        await hub_end.send(b"REPLICATE\n")
        await eventually(lambda: handler.sessions[0].lines == ["REPLICATE"], "client got it")
        assert handler.sessions[0].link.label == "tcp:hub"
        await hub_end.close()
        await eventually(lambda: handler.sessions[0].closed_calls == 1, "session closed")


async def test_hub_and_client_open_sessions_on_both_ends() -> None:
    hub_handler, handler = RecordingHandler("hub"), RecordingHandler("c1", up=False)
    metrics = ReplicationMetrics()

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("plait_connection_up", {"link": "tcp:c1"})

    async with running_hub(hub_handler, metrics=metrics) as hub:
        async with running_client(handler, hub.port) as client:
            assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
            await eventually(lambda: len(hub_handler.sessions) == 1, "the hub opened")
            hub_session, session = hub_handler.sessions[0], handler.sessions[0]
            assert hub_session.link.label == "tcp:c1"
            # each end's REPLICATE (sent by open) reached the other end's session
            await eventually(lambda: session.lines == ["REPLICATE"], "the hub's line at the client")
            await eventually(lambda: hub_session.lines == ["REPLICATE"], "the client's at the hub")
            # the hub reports a connection up once its session says so
            await eventually(lambda: gauge() == 1.0, "up at the hub")
        await eventually(lambda: hub_session.closed_calls == 1, "closed at the hub")
        assert gauge() == 0.0


async def test_either_handler_can_drop_a_connection() -> None:
    hub_handler, handler = RecordingHandler("hub"), RecordingHandler("c1")
    async with (
        running_hub(hub_handler) as hub,
        running_client(handler, hub.port, backoff=Backoff(initial=0.02)) as client,
    ):
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        handler.sessions[0].link.close()  # e.g. catching up failed on this connection
        await eventually(
            lambda: len(handler.sessions) == len(hub_handler.sessions) == 2, "a new connection"
        )
        await eventually(lambda: len(hub_handler.live()) == len(handler.live()) == 1, "one each")
        hub_handler.sessions[1].link.close()  # and the hub's end of the new one
        await eventually(
            lambda: len(handler.sessions) == len(hub_handler.sessions) == 3, "another connection"
        )
        await eventually(lambda: len(hub_handler.live()) == len(handler.live()) == 1, "one each")
        assert [s.closed_calls for s in handler.sessions] == [1, 1, 0]
        assert [s.closed_calls for s in hub_handler.sessions] == [1, 1, 0]


# -- 2. relay ----------------------------------------------------------------------------


async def test_hub_relays_to_every_other_client_in_order_and_never_back() -> None:
    hub_handler = RecordingHandler("hub")
    handlers = {name: RecordingHandler(name) for name in "abc"}
    async with (
        running_hub(hub_handler) as hub,
        running_client(handlers["a"], hub.port) as a,
        running_client(handlers["b"], hub.port) as b,
        running_client(handlers["c"], hub.port) as c,
    ):
        for client in (a, b, c):
            assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        await eventually(lambda: len(hub_handler.live()) == 3, "three clients at the hub")
        a_session, b_session, c_session = (handlers[n].sessions[0] for n in "abc")
        others = (b_session, c_session, hub_handler.session_of("tcp:a"))

        lines = [f"POSITION s a {i} {i + 1}" for i in range(1000)]
        for line in lines:
            a_session.link.send(line)
        await eventually(
            lambda: all(len(s.matching("POSITION s a")) == 1000 for s in others), "all lines"
        )
        for session in others:
            assert session.matching("POSITION s a") == lines  # verbatim, in order
        # Not relayed, nor handed on at all: the transport's own commands, and ERROR (it
        # answers one line, and goes to the hub's log); a marker shows the rest arrived.
        for line in ("PING 1", "NAME z", "SERVER z", "ERROR oops", "POSITION s a 1000 1001"):
            a_session.link.send(line)
        await eventually(lambda: all("POSITION s a 1000 1001" in s.lines for s in others), "mark")
        for session in others:
            for prefix in ("PING", "NAME", "SERVER", "ERROR"):
                assert session.matching(prefix) == []

        # the hub's handler sends its own commands through each link
        hub_handler.send_all("POSITION s hub 0 7")
        clients = (a_session, b_session, c_session)
        await eventually(lambda: all("POSITION s hub 0 7" in s.lines for s in clients), "hub's")
        await asyncio.sleep(0.05)
        assert a_session.matching("POSITION s a") == []  # never echoed to its sender
        for handler in (hub_handler, *handlers.values()):
            assert all(s.closed_calls == 0 for s in handler.sessions)


# -- 3. pings and dead peers -------------------------------------------------------------


async def test_hub_pings_and_closes_a_peer_that_goes_silent() -> None:
    hub_handler = RecordingHandler("hub")
    async with running_hub(hub_handler, ping_interval=0.05, dead_after=0.4) as hub:
        peer = await RawPeer.connect(hub.port)
        await peer.handshake("quiet")
        started = time.monotonic()
        lines = await peer.rest()  # it says nothing more, so the hub hangs up
        elapsed = time.monotonic() - started
        assert 0.35 <= elapsed < 1.5, elapsed
        assert lines[0] == "REPLICATE"
        pings = lines[1:]
        assert len(pings) >= 3
        assert all(p.startswith("PING ") for p in pings), pings
        assert abs(int(pings[-1].split()[1]) - time.time() * 1000) < 5000  # the sender's clock
        await eventually(lambda: hub_handler.sessions[0].closed_calls == 1, "session closed")
        await peer.close()


async def test_pings_keep_a_quiet_connection_up_and_never_reach_sessions() -> None:
    hub_handler, handler = RecordingHandler("hub"), RecordingHandler("c1")
    pace = slowness()  # a busy machine holds the loop longer than a quiet one's dead_after
    fast = {"ping_interval": 0.05 * pace, "dead_after": 0.25 * pace}
    async with (
        running_hub(hub_handler, **fast) as hub,
        running_client(handler, hub.port, **fast) as client,
    ):
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        await asyncio.sleep(0.6 * pace)  # several dead_after periods with nothing but pings
        assert len(handler.sessions) == len(hub_handler.sessions) == 1
        assert handler.sessions[0].closed_calls == hub_handler.sessions[0].closed_calls == 0
        assert handler.sessions[0].lines == hub_handler.sessions[0].lines == ["REPLICATE"]


async def test_client_pings_and_reconnects_when_the_hub_goes_silent() -> None:
    handler = RecordingHandler("c1")
    async with (
        FakeHub() as fake,
        running_client(
            handler, fake.port, ping_interval=0.05, dead_after=0.3, backoff=Backoff(initial=0.02)
        ),
    ):
        hub_end = await fake.accept()
        assert await hub_end.line() == "NAME c1"
        await hub_end.send(b"SERVER fake\n")
        assert await hub_end.line() == "REPLICATE"
        assert (await hub_end.line()).startswith("PING ")
        assert (await hub_end.line()).startswith("PING ")
        started = time.monotonic()
        second = await fake.accept()  # silent hub: the client gives up and comes back
        assert 0.15 <= time.monotonic() - started < 1.5
        assert handler.sessions[0].closed_calls == 1
        assert await second.line() == "NAME c1"


# -- 4. the send-queue limit -------------------------------------------------------------


async def test_a_burst_beyond_the_queue_to_a_peer_that_keeps_up_is_sent_not_refused() -> None:
    """More lines than the queue holds, sent before the writer task can run, to a peer
    whose socket takes them: they go out at once; only a peer that stops reading is
    too slow (next test)."""
    hub_handler, other = RecordingHandler("hub"), RecordingHandler("other")
    async with (
        running_hub(hub_handler, send_queue=10) as hub,
        running_client(other, hub.port) as client,
    ):
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        peer = await connected_trio(hub, hub_handler, other, "slow")
        slow_link = hub_handler.session_of("tcp:slow").link
        other_link = hub_handler.session_of("tcp:other").link
        for i in range(25):  # more than twice what the queue holds, in one go
            slow_link.send(f"POSITION s hub {i} {i + 1}")
        for i in range(10):  # exactly what the queue holds
            other_link.send(f"POSITION s hub {i} {i + 1}")
        got = [await peer.line() for _ in range(25)]
        assert got == [f"POSITION s hub {i} {i + 1}" for i in range(25)]  # all, in order
        await eventually(lambda: len(other.sessions[0].matching("POSITION")) == 10, "other")
        assert hub_handler.sessions[1].closed_calls == 0
        assert other.sessions[0].closed_calls == 0
        assert len(hub_handler.live()) == 2
        await peer.close()


def _small_window_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
    sock.setblocking(False)
    return sock


async def _recv_line(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """One line from a bare socket, read a byte at a time so nothing more is consumed."""
    data = b""
    async with within(WAIT, "a line from the hub"):
        while not data.endswith(b"\n"):
            byte = await loop.sock_recv(sock, 1)
            assert byte, "the hub hung up"
            data += byte
    return data


class StuckPeer:
    """A peer "stuck" that, once past the handshake, reads nothing (until `last_line`)
    through a small window: the hub's buffers for it fill, and its writer waits in
    drain()."""

    def __init__(self, hub: TcpHub, hub_handler: RecordingHandler) -> None:
        self.hub = hub
        self.hub_handler = hub_handler
        self.sock = _small_window_socket()
        self.loop = asyncio.get_running_loop()

    async def __aenter__(self) -> RecordingSession:
        """Its session at the hub."""
        await self.loop.sock_connect(self.sock, (HOST, self.hub.port))
        await self.loop.sock_sendall(self.sock, b"NAME stuck\n")
        assert await _recv_line(self.loop, self.sock) == b"SERVER hub\n"
        live = self.hub_handler.live
        await eventually(lambda: any(s.link.label == "tcp:stuck" for s in live()), "at the hub")
        return self.hub_handler.session_of("tcp:stuck")

    async def __aexit__(self, *exc: object) -> None:
        self.sock.close()

    async def last_line(self) -> str:
        """Read everything the hub sent, until it hung up; the last line of it."""
        data = b""
        async with within(WAIT, "the hub to hang up on the stuck peer"):
            while chunk := await self.loop.sock_recv(self.sock, 1 << 20):
                data += chunk
        return data.decode().splitlines()[-1]


async def _send_until_closed(
    hub_handler: RecordingHandler, stuck: RecordingSession, size: int
) -> int:
    """Send a line of about `size` bytes to every peer of the hub, a line each
    millisecond, until `stuck` is closed; how many were sent."""
    sent = 0
    payload = "x" * size
    async with within(WAIT, "the stuck peer to be closed"):
        while not stuck.closed_calls:
            hub_handler.send_all(f"POSITION s hub {sent} {sent + 1} {payload}")
            sent += 1
            await asyncio.sleep(0.001)
    return sent


async def test_a_peer_that_never_reads_is_closed_and_others_get_everything() -> None:
    hub_handler, other = RecordingHandler("hub"), RecordingHandler("other")
    async with (
        running_hub(hub_handler, send_queue=10) as hub,
        running_client(other, hub.port) as client,
    ):
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        peer = StuckPeer(hub, hub_handler)
        async with peer as stuck:
            sent = await _send_until_closed(hub_handler, stuck, 16_000)
            assert sent > 10
            # The ERROR came after everything already written; the hub still lets the
            # peer read it before hanging up.
            last = await peer.last_line()
            assert last.startswith("ERROR send queue full (10 lines)"), last[:100]
        # the other client got every line, in order, and stayed up
        await eventually(lambda: len(other.sessions[0].matching("POSITION")) == sent, "all")
        numbers = [int(line.split()[3]) for line in other.sessions[0].matching("POSITION")]
        assert numbers == list(range(sent))
        assert other.sessions[0].closed_calls == 0


# -- 5. framing and handshake errors -------------------------------------------------


@pytest.mark.parametrize(
    ("first", "error"),
    [
        pytest.param(
            b"HELLO there\n",
            "ERROR expected NAME <name> first: unknown command 'HELLO'",
            id="unknown command",
        ),
        pytest.param(b"PING 5\n", "ERROR expected NAME <name> first, got PING", id="not NAME"),
        pytest.param(
            b"NAME two words\n",
            "ERROR expected NAME <name> first: bad name name 'two words'",
            id="bad name",
        ),
        pytest.param(
            b"\xff\xfe\n", "ERROR expected NAME <name> first: line is not UTF-8", id="not UTF-8"
        ),
        pytest.param(b"N" * (MAX_LINE_BYTES + 10) + b"\n", "ERROR line too long", id="too long"),
    ],
)
async def test_a_bad_first_line_is_answered_with_error_and_closed(first: bytes, error: str) -> None:
    hub_handler = RecordingHandler("hub")
    async with running_hub(hub_handler) as hub:
        peer = await RawPeer.connect(hub.port)
        await peer.send(first)
        rest = await peer.rest()
        assert len(rest) == 1
        assert rest[0].startswith(error), rest[0][:200]
        assert hub_handler.sessions == []
        await peer.close()


async def test_no_name_within_the_handshake_timeout_is_answered_with_error_and_closed() -> None:
    hub_handler = RecordingHandler("hub")
    async with running_hub(hub_handler, handshake_timeout=0.2) as hub:
        peer = await RawPeer.connect(hub.port)
        started = time.monotonic()
        assert await peer.rest() == ["ERROR expected NAME <name> within 0.2s"]
        assert 0.15 <= time.monotonic() - started < 1.5
        assert hub_handler.sessions == []
        await peer.close()


async def test_line_limit_after_the_handshake() -> None:
    hub_handler, other = RecordingHandler("hub"), RecordingHandler("other")
    async with running_hub(hub_handler) as hub, running_client(other, hub.port) as client:
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        peer = await connected_trio(hub, hub_handler, other)
        at_hub = hub_handler.session_of("tcp:raw")
        # exactly the limit (with "\r\n") is fine, and relayed
        longest = "RDATA " + "x" * (MAX_LINE_BYTES - 6)
        await peer.send(longest.encode() + b"\r\n")
        await eventually(lambda: at_hub.lines == [longest], "the longest line at the hub")
        await eventually(lambda: longest in other.sessions[0].lines, "relayed")
        # a line that is not UTF-8 goes to the session (which answers it), never relayed
        await peer.send(b"RDATA \xff\n")
        await eventually(lambda: len(at_hub.lines) == 2, "the bad line at the hub")
        # one byte over: ERROR, and the connection closes
        await peer.send(b"y" * (MAX_LINE_BYTES + 1) + b"\n")
        rest = await peer.rest()
        assert rest[-1].startswith("ERROR line too long")
        await eventually(lambda: at_hub.closed_calls == 1, "session closed")
        assert len(other.sessions[0].lines) == 2  # REPLICATE and the longest line
        assert other.sessions[0].closed_calls == 0
        await peer.close()


# -- 6. reconnects and backoff -------------------------------------------------------


async def test_client_reconnects_with_growing_delays_and_resets_only_when_up() -> None:
    events: list[str] = []
    hub_handler = RecordingHandler("hub")
    handler = RecordingHandler("c1", up=False, events=events)
    backoff = RecordingBackoff(events, initial=0.02, cap=1.0)
    metrics = ReplicationMetrics()

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("plait_connection_up", {"link": "tcp:hub"})

    def reconnects() -> float:
        value = metrics.registry.get_sample_value("plait_reconnects_total", {"link": "tcp:hub"})
        return value or 0.0

    hub = TcpHub(hub_handler, TcpOptions(host=HOST, port=0))
    await hub.start()
    port = hub.port
    async with running_client(handler, port, backoff=backoff, metrics=metrics) as client:
        try:
            assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
            await asyncio.sleep(0.1)
            assert backoff.ups == 0  # open is not up: the session has not caught up
            assert gauge() in (None, 0.0)
            handler.up.set()
            await eventually(lambda: backoff.ups == 1, "backoff reset once up")
            assert events == ["open: tcp:hub", "wait_up returned: tcp:hub", "backoff up"]
            assert gauge() == 1.0
        finally:
            await hub.stop()

        await eventually(lambda: handler.sessions[0].closed_calls == 1, "session closed")
        assert gauge() == 0.0
        await eventually(lambda: len(backoff.delays) >= 4, "four refused attempts")
        assert backoff.delays[:4] == pytest.approx([0.02, 0.04, 0.08, 0.16])
        assert reconnects() >= 3
        assert backoff.ups == 1
        assert not await client.wait_open(0.01)

        async with running_hub(hub_handler, port=port):
            assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
            await eventually(lambda: backoff.ups == 2, "up again")
            assert len(handler.sessions) == 2
            assert handler.sessions[1].closed_calls == 0
            assert events[-3:] == ["open: tcp:hub", "wait_up returned: tcp:hub", "backoff up"]
            assert gauge() == 1.0


async def test_a_connection_that_fails_before_it_is_up_keeps_growing_the_delay() -> None:
    events: list[str] = []
    handler = RecordingHandler("c1", up=False, events=events)
    backoff = RecordingBackoff(events, initial=0.02, cap=1.0)
    async with FakeHub() as fake, running_client(handler, fake.port, backoff=backoff):
        for _ in range(5):  # handshake, then hang up at once: never up
            hub_end = await fake.accept()
            assert await hub_end.line() == "NAME c1"
            await hub_end.send(b"SERVER fake\n")
            await hub_end.close()
        await eventually(lambda: len(backoff.delays) >= 5, "five failures")
        assert backoff.delays[:5] == pytest.approx([0.02, 0.04, 0.08, 0.16, 0.32])
        assert backoff.ups == 0
        assert [s.closed_calls for s in handler.sessions[:5]] == [1] * 5


async def test_client_treats_error_in_the_handshake_as_a_failure() -> None:
    handler = RecordingHandler("c1")
    backoff = RecordingBackoff([], initial=0.02, cap=1.0)
    async with FakeHub() as fake, running_client(handler, fake.port, backoff=backoff):
        hub_end = await fake.accept()
        assert await hub_end.line() == "NAME c1"
        await hub_end.send(b"ERROR go away\n")
        second = await fake.accept()
        assert await second.line() == "NAME c1"
        assert handler.sessions == []
        assert backoff.delays == [pytest.approx(0.02)]


# -- 7. lifetimes ------------------------------------------------------------------------


async def test_stop_ends_every_task_promptly() -> None:
    before = asyncio.all_tasks()
    hub_handler = RecordingHandler("hub")
    handlers = [RecordingHandler(f"c{i}") for i in range(3)]
    hub = TcpHub(hub_handler, TcpOptions(host=HOST, port=0, ping_interval=0.05))
    await hub.start()
    fast = TcpOptions(host=HOST, port=hub.port, ping_interval=0.05)
    clients = [TcpClient(h, fast) for h in handlers]
    for client in clients:
        await client.start()
    for client in clients:
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
    handshaking = await RawPeer.connect(hub.port)  # stopped in the middle of its handshake
    await eventually(lambda: len(hub_handler.live()) == 3, "three clients at the hub")
    handlers[0].sessions[0].link.send("POSITION s c0 0 1")
    hub_handler.send_all("POSITION s hub 0 1")
    await asyncio.sleep(0.1)
    assert len(asyncio.all_tasks() - before) > 3 * 4  # readers, writers, pingers, watchers

    started = time.monotonic()
    await clients[0].stop()
    await hub.stop()
    for client in clients[1:]:
        await client.stop()
    assert time.monotonic() - started < 0.5
    assert asyncio.all_tasks() - before == set()
    assert all(s.closed_calls == 1 for h in (hub_handler, *handlers) for s in h.sessions)
    assert await handshaking.rest() == []  # hung up without a word
    await handshaking.close()


async def test_stop_flushes_what_is_queued() -> None:
    hub_handler, handler = RecordingHandler("hub"), RecordingHandler("c1")
    async with running_hub(hub_handler) as hub:
        client = TcpClient(handler, TcpOptions(host=HOST, port=hub.port))
        await client.start()
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        await eventually(lambda: len(hub_handler.sessions) == 1, "at the hub")
        for i in range(100):  # still queued when stop() begins: a departure, say
            handler.sessions[0].link.send(f"POSITION s c1 {i} {i + 1}")
        await client.stop()
        at_hub = hub_handler.sessions[0]
        await eventually(lambda: at_hub.closed_calls == 1, "closed at the hub")
        assert len(at_hub.matching("POSITION")) == 100


# -- 8. hostile and broken clients -------------------------------------------------------


async def test_a_line_the_hub_refuses_is_never_relayed_and_reactions_follow_the_relay() -> None:
    hub_handler, other = RecordingHandler("hub"), RecordingHandler("other")
    async with running_hub(hub_handler) as hub, running_client(other, hub.port) as client:
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        peer = await connected_trio(hub, hub_handler, other)
        at_other = other.sessions[0]
        await peer.send(
            b"RDATA bad raw\nRDATA \xff\nno command\nAPP_UNKNOWN 1\nREACT 1\nPOSITION s raw 0 1\n"
        )
        assert (await peer.line()).startswith("ERROR cannot parse RDATA bad")
        assert (await peer.line()).startswith("ERROR cannot parse RDATA")
        assert (await peer.line()).startswith("ERROR cannot parse APP_UNKNOWN")
        await eventually(lambda: "POSITION s raw 0 1" in at_other.lines, "the good lines")
        # Refused lines reached the hub's session only, but for an application's command
        # (the hub need not know it); the hub's reaction to a line comes after that line.
        assert at_other.lines == [
            "REPLICATE",
            "APP_UNKNOWN 1",
            "REACT 1",
            "REACTION to REACT 1",
            "POSITION s raw 0 1",
        ]
        assert (await peer.line()) == "REACTION to REACT 1"
        await peer.close()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(b"RDATA bad raw\n", id="refused by the session"),
        pytest.param(b"POSITION s other 0 1\n", id="in another instance's name"),
        pytest.param(b"no command here\n", id="no command name"),
        pytest.param(b"NAME again\n", id="NAME after the handshake"),
        pytest.param(b"REPLICATE\n", id="REPLICATE over and over"),
        pytest.param(b"RDATA s hub 5 {}\n", id="rows in the hub's name"),
    ],
)
async def test_bad_lines_past_the_budget_close_the_peer_and_only_it(
    bad: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "At once" is under half the close grace: on a busy machine both stretch.
    monkeypatch.setattr(tcp_connection, "CLOSE_GRACE", scaled(tcp_connection.CLOSE_GRACE))
    hub_handler, other = RecordingHandler("hub"), RecordingHandler("other")
    async with running_hub(hub_handler) as hub, running_client(other, hub.port) as client:
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        peer = await connected_trio(hub, hub_handler, other)
        at_hub = hub_handler.session_of("tcp:raw")
        marker = "POSITION s raw 0 1"  # once the hub has it, it has taken every line before
        await peer.send(bad * 50 + f"{marker}\n".encode())  # within the budget of 100
        await eventually(lambda: marker in at_hub.lines, "the marker at the hub")
        assert at_hub.closed_calls == 0
        started = time.monotonic()
        await peer.send(bad * 200)
        rest = await peer.rest()
        assert rest[-1].startswith("ERROR too many bad lines (over 100"), rest[-1]
        # hung up at once, not at the end of the hub's close grace
        assert time.monotonic() - started < tcp_connection.CLOSE_GRACE / 2
        await eventually(lambda: at_hub.closed_calls == 1, "closed at the hub")
        relayed = other.sessions[0].lines[1:].count(bad.decode().strip())  # past the hub's
        assert relayed == (3 if bad.startswith(b"REPLICATE") else 0)  # a few are free
        assert other.sessions[0].closed_calls == 0
        if bad.startswith(b"RDATA s hub"):
            assert "ERROR RDATA of hub refused" in rest[0]
        await peer.close()


async def test_errors_from_a_peer_are_logged_never_fatal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An ERROR may answer a line that was fine for the hub (another version), so it
    never closes a connection; it goes to the hub's log (one line per interval and
    address, whatever their number), never to the session."""
    caplog.set_level(logging.WARNING, logger="plait")
    hub_handler = RecordingHandler("hub")
    async with running_hub(hub_handler) as hub:
        peer = await RawPeer.connect(hub.port)
        await peer.handshake("raw")
        await eventually(lambda: len(hub_handler.live()) == 1, "at the hub")
        at_hub = hub_handler.sessions[0]
        await peer.send(b"ERROR you are wrong\n" * 500 + b"POSITION s raw 0 1\n")
        await eventually(lambda: "POSITION s raw 0 1" in at_hub.lines, "the marker")
        assert at_hub.lines == ["POSITION s raw 0 1"]
        assert at_hub.closed_calls == 0
        assert [r.getMessage() for r in caplog.records] == [
            "tcp hub: 127.0.0.1: tcp:raw says: you are wrong"
        ]
        await peer.close()


async def test_a_slow_peer_is_closed_at_the_byte_limit_before_the_line_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lines may be up to a MiB each: `send_queue` lines of them could be gigabytes."""
    monkeypatch.setattr(tcp_connection, "MAX_BUFFERED_BYTES", 1 << 20)
    hub_handler = RecordingHandler("hub")
    async with running_hub(hub_handler, send_queue=10_000) as hub:
        peer = StuckPeer(hub, hub_handler)
        async with peer as stuck:
            sent = await _send_until_closed(hub_handler, stuck, 64_000)
            assert sent < 100  # far below the 10 000 lines send_queue allows
            assert await peer.last_line() == (
                "ERROR send queue full (1 MiB): closing; reconnect and catch up"
            )


# -- 9. lines carry the sender's name ----------------------------------------------------


async def test_a_client_cannot_speak_for_another_instance() -> None:
    """The issue's attack: a peer that said NAME evil sends positions and rows of other
    writers. None reaches the hub's session or another client; of lines about another
    writer only FENCED is relayed (receivers check it against the database)."""
    hub_handler, other = RecordingHandler("hub"), RecordingHandler("w2")
    async with running_hub(hub_handler) as hub, running_client(other, hub.port) as client:
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        peer = await connected_trio(hub, hub_handler, other, "evil")
        at_hub, at_other = hub_handler.session_of("tcp:evil"), other.sessions[0]
        attack = [
            "POSITION notes w2 0 1000000000",
            'RDATA notes w1 32 {"body":"forged"}',
            "RDATA notes w2 batch {}",
            "POSITION notes w1 5 9",
            "POSITION notes w1 7 7",  # a fence went as POSITION p p once: now FENCED only
            "POSITION notes hub 3 3",  # the hub's own: never from a client
            "DEPART w2",
        ]
        allowed = ["FENCED notes w1 7", "POSITION notes evil 0 1", "DEPART evil"]
        await peer.send(("\n".join(attack + allowed) + "\n").encode())
        await eventually(lambda: "DEPART evil" in at_other.lines, "the allowed lines relayed")
        await eventually(lambda: "DEPART evil" in at_hub.lines, "the allowed lines at the hub")
        assert at_hub.lines == allowed
        assert at_other.lines == ["REPLICATE", *allowed]
        errors = [await peer.line() for _ in attack]
        assert errors[0] == (
            "ERROR POSITION of w2 refused: this connection is evil, and only w2 sends its "
            "own (a fence of another writer goes as FENCED, which receivers check against "
            "the database)"
        )
        assert all(re.match(r"ERROR (RDATA|POSITION|DEPART) of \w+ refused", e) for e in errors)
        assert at_hub.closed_calls == 0  # a few bad lines are within the budget
        await peer.close()


# Lines of a command name and fields, apart by a space mostly, else by two, by other
# whitespace or by nothing; each field mostly of the kind its place takes, names that
# share a prefix, and a field too many or too few now and then.
_ARITY = {"RDATA": 4, "POSITION": 4, "DEPART": 1}
_separators = st.sampled_from([" "] * 12 + ["  ", "\t", "\u00a0", ""])
_names = st.sampled_from(["w2", "w2x", "evil", "{}"])
_numbers = st.sampled_from(["1", "-1", "5", "5", "batch"])


@st.composite
def _lines(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(sorted(_ARITY)))
    count = draw(st.sampled_from([_ARITY[name]] * 4 + [0, 1, 2, 3, 4, 5]))
    kinds = [_names, _names, _numbers, _numbers | st.just("[1]"), _names | _numbers]
    fields = [draw(kinds[i] if name != "DEPART" else _names) for i in range(count)]
    return name + "".join(draw(_separators) + field for field in fields)


@given(_lines())
def test_the_hub_reads_the_name_of_a_line_as_receivers_parse_it(line: str) -> None:
    """The hub checks the instance name of a line without parsing it (a row may be a
    MiB); whenever receivers parse the line, they must find the same name, or a line
    could pass the hub as the sender's own and arrive as another writer's."""
    try:
        command = CommandSet().parse(line)
    except CommandParseError:
        return  # refused by every receiver (and by the hub's session: never relayed)
    if isinstance(command, Rdata | Position):
        assert tcp_protocol.field_of(line, 2) == command.instance
        assert rows_of(line, command.instance)
    elif isinstance(command, Depart):
        assert tcp_protocol.field_of(line, 1) == command.name


async def test_a_second_connection_under_a_name_in_use_replaces_the_first() -> None:
    """A name is held by one connection at a time: the newer one (the instance has
    reconnected before the hub noticed the old connection died)."""
    hub_handler = RecordingHandler("hub")
    async with running_hub(hub_handler) as hub:
        first = await RawPeer.connect(hub.port)
        await first.handshake("w2")
        assert await first.line() == "REPLICATE"
        second = await RawPeer.connect(hub.port)
        await second.handshake("w2")
        assert await second.line() == "REPLICATE"
        assert await first.rest() == ["ERROR replaced by a newer connection named w2"]
        await eventually(lambda: hub_handler.sessions[0].closed_calls == 1, "the first closed")
        await second.send(b"POSITION s w2 0 1\n")
        await eventually(lambda: hub_handler.sessions[1].lines == ["POSITION s w2 0 1"], "second")
        assert [s.link.label for s in hub_handler.live()] == ["tcp:w2"]
        await first.close()
        await second.close()


async def test_a_client_may_not_take_the_hubs_own_name() -> None:
    hub_handler = RecordingHandler("hub")
    async with running_hub(hub_handler) as hub:
        peer = await RawPeer.connect(hub.port)
        await peer.send(b"NAME hub\n")
        assert await peer.rest() == [
            "ERROR NAME hub is the hub's own name: name every instance differently"
        ]
        assert hub_handler.sessions == []
        await peer.close()


# -- 10. authentication with the replication secret ----------------------------------


SECRET = "correct horse battery staple"


def proof(secret: str, role: str, client: str, hub: str, hub_nonce: str, nonce: str) -> str:
    """The proof as the protocol defines it, written out again here to pin it down:
    HMAC-SHA256 under the secret of the role, both names and both nonces."""
    message = f"plait-tcp-1 {role} {client} {hub} {hub_nonce} {nonce}"
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


async def test_with_a_secret_the_hub_and_client_prove_it_to_each_other() -> None:
    hub_handler, handler = RecordingHandler("hub"), RecordingHandler("c1")
    async with (
        running_hub(hub_handler, secret=SECRET) as hub,
        running_client(handler, hub.port, secret=SECRET) as client,
    ):
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        await eventually(lambda: len(hub_handler.live()) == 1, "open at the hub")
        assert hub_handler.sessions[0].link.label == "tcp:c1"
        await eventually(lambda: handler.sessions[0].lines == ["REPLICATE"], "the hub's line")
        await eventually(lambda: hub_handler.sessions[0].lines == ["REPLICATE"], "the client's")
        # The handler is told: it then takes a writer's word about its own IDs.
        assert hub_handler.sessions[0].authenticated
        assert handler.sessions[0].authenticated


async def test_the_handshake_with_a_secret_on_the_wire_and_no_replay() -> None:
    hub_handler = RecordingHandler("hub")
    async with running_hub(hub_handler, secret=SECRET) as hub:
        peer = await RawPeer.connect(hub.port)
        await peer.send(b"NAME raw\n")
        challenge = (await peer.line()).split(" ")
        assert challenge[:2] == ["CHALLENGE", "hub"]
        hub_nonce = challenge[2]
        assert re.fullmatch("[0-9a-f]{32}", hub_nonce)
        nonce = "0123456789abcdef" * 2
        mine = proof(SECRET, "client", "raw", "hub", hub_nonce, nonce)
        await peer.send(f"PROOF {nonce} {mine}\n".encode())
        theirs = proof(SECRET, "hub", "raw", "hub", hub_nonce, nonce)
        assert await peer.line() == f"SERVER hub {theirs}"
        assert await peer.line() == "REPLICATE"
        assert [s.link.label for s in hub_handler.live()] == ["tcp:raw"]

        # The same proof again on a new connection: the hub's nonce is new, so it fails.
        again = await RawPeer.connect(hub.port)
        await again.send(b"NAME raw\n")
        assert (await again.line()).startswith("CHALLENGE hub ")
        await again.send(f"PROOF {nonce} {mine}\n".encode())
        assert await again.rest() == [
            "ERROR authentication failed: the proof does not match this hub's "
            "replication.secret; set the same replication.secret on every instance"
        ]
        assert len(hub_handler.sessions) == 1
        await peer.close()
        await again.close()


async def test_without_the_secret_nothing_gets_past_the_handshake() -> None:
    """The issue's attack at a hub with a secret: no line but the handshake is taken."""
    hub_handler, other = RecordingHandler("hub"), RecordingHandler("w2")
    async with (
        running_hub(hub_handler, secret=SECRET) as hub,
        running_client(other, hub.port, secret=SECRET) as client,
    ):
        assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        peer = await RawPeer.connect(hub.port)
        await peer.send(b"NAME evil\n")
        assert (await peer.line()).startswith("CHALLENGE hub ")
        await peer.send(b"POSITION notes w2 0 1000000000\nRDATA notes w1 32 {}\n")
        assert await peer.rest() == ["ERROR expected PROOF <nonce> <proof>, got POSITION"]
        assert [s.link.label for s in hub_handler.sessions] == ["tcp:w2"]
        assert other.sessions[0].lines == ["REPLICATE"]
        await peer.close()


async def test_the_client_checks_the_hubs_proof() -> None:
    """A fake hub without the secret: reflecting the client's own proof back, or sending
    any other, gets it nowhere; the client opens only on the true proof."""
    handler = RecordingHandler("c1")
    backoff = RecordingBackoff([], initial=0.02, cap=0.1)
    async with (
        FakeHub() as fake,
        running_client(handler, fake.port, secret=SECRET, backoff=backoff),
    ):
        for answer in ("reflect", "random", "true"):
            hub_end = await fake.accept()
            assert await hub_end.line() == "NAME c1"
            hub_nonce = "fe" * 16
            await hub_end.send(f"CHALLENGE fake {hub_nonce}\n".encode())
            _, nonce, mine = (await hub_end.line()).split(" ")
            assert mine == proof(SECRET, "client", "c1", "fake", hub_nonce, nonce)
            theirs = {
                "reflect": mine,
                "random": "ab" * 32,
                "true": proof(SECRET, "hub", "c1", "fake", hub_nonce, nonce),
            }[answer]
            await hub_end.send(f"SERVER fake {theirs}\n".encode())
            if answer != "true":
                assert (await hub_end.rest())[0].startswith("ERROR the hub's proof")
                assert handler.sessions == []
        await eventually(lambda: len(handler.sessions) == 1, "the client opened")


@pytest.mark.parametrize(
    ("hub_secret", "client_secret", "client_says", "hub_says"),
    [
        pytest.param(
            SECRET,
            "another secret",
            "the hub refused the connection: authentication failed: the proof does not "
            "match this hub's replication.secret",
            "authentication failed",
            id="different secrets",
        ),
        pytest.param(
            SECRET,
            None,
            "the hub asks for proof of the replication secret and this instance has "
            "none: set replication.secret",
            "has no replication.secret",
            id="only the hub has one",
        ),
        pytest.param(
            None,
            SECRET,
            "the hub hub did not ask for proof of the replication secret: it has none, "
            "and this instance has one: set the same replication.secret",
            "did not ask for proof",
            id="only the client has one",
        ),
    ],
)
async def test_secrets_that_differ_fail_clearly_on_both_ends(
    caplog: pytest.LogCaptureFixture,
    hub_secret: str | None,
    client_secret: str | None,
    client_says: str,
    hub_says: str,
) -> None:
    caplog.set_level(logging.DEBUG, logger="plait")
    hub_handler, handler = RecordingHandler("hub"), RecordingHandler("c1")

    def said(who: str, text: str) -> bool:
        return any(
            r.levelno >= logging.WARNING
            and r.getMessage().startswith(who)
            and text in r.getMessage()
            for r in caplog.records
        )

    async with (
        running_hub(hub_handler, secret=hub_secret) as hub,
        running_client(handler, hub.port, secret=client_secret) as client,
    ):
        await eventually(lambda: said("tcp client:", client_says), "the client's warning")
        await eventually(lambda: said("tcp hub:", hub_says), "the hub's warning")
        assert not await client.wait_open(0.01)
        assert handler.sessions == []
    secrets = {SECRET, "another secret"}
    assert not [r for r in caplog.records if any(s in r.getMessage() for s in secrets)]


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", ""])
async def test_a_hub_off_loopback_needs_a_secret(host: str) -> None:
    hub = TcpHub(RecordingHandler("hub"), TcpOptions(host=host, port=0))
    with pytest.raises(ConfigError, match=r"without a secret.*set replication\.secret"):
        await hub.start()
    await hub.stop()


async def test_a_hub_with_a_secret_may_listen_everywhere() -> None:
    async with running_hub(RecordingHandler("hub"), secret=SECRET) as hub:
        assert hub.port > 0


# -- 11. handshake slots per address, and logs that cannot be flooded ----------------


async def test_idle_sockets_from_one_address_do_not_lock_out_another() -> None:
    """Finding 6: 70 sockets that never say NAME, from one address, used to take every
    handshake slot. The listening socket's queue is first in, first out: by the time
    the hub takes the peer from 127.0.0.2, it has taken (or refused) all 70."""
    hub_handler = RecordingHandler("hub")
    async with running_hub(hub_handler, handshake_timeout=30) as hub:
        idle = [await RawPeer.connect(hub.port) for _ in range(70)]
        peer = await RawPeer.connect(hub.port, source="127.0.0.2")
        await peer.handshake("legit")
        assert hub._handshaking == tcp_transport._MAX_HANDSHAKING_PER_ADDRESS
        refused = idle[tcp_transport._MAX_HANDSHAKING_PER_ADDRESS :]
        for one in refused:
            assert await one.rest() == [
                "ERROR too many connections from your address in the handshake; try again later"
            ]
        for one in (*idle, peer):
            await one.close()


async def test_connections_past_the_global_handshake_limit_are_refused_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tcp_transport, "_MAX_HANDSHAKING", 5)
    monkeypatch.setattr(tcp_transport, "_MAX_HANDSHAKING_PER_ADDRESS", 3)
    hub_handler, handler = RecordingHandler("hub"), RecordingHandler("c1")
    async with running_hub(hub_handler, handshake_timeout=scaled(0.5)) as hub:
        sources = ["127.0.0.2"] * 3 + ["127.0.0.3"] * 2
        waiting = [await RawPeer.connect(hub.port, source) for source in sources]  # silent
        await eventually(lambda: hub._handshaking == 5, "five in the handshake at the hub")
        started = time.monotonic()
        refused = await RawPeer.connect(hub.port, source="127.0.0.4")
        assert await refused.rest() == [
            "ERROR too many connections in the handshake; try again later"
        ]
        assert time.monotonic() - started < scaled(0.3)  # not at the handshake timeout
        # once the silent ones are cut off at the handshake timeout, clients get in
        for peer in waiting:
            assert (await peer.rest())[0].startswith("ERROR expected NAME <name> within")
        async with running_client(handler, hub.port) as client:
            assert await client.wait_open(scaled(WAIT)), f"not open within {scaled(WAIT):.1f} s"
        for peer in (*waiting, refused):
            await peer.close()


def _counted(records: list[logging.LogRecord], address: str) -> tuple[int, int]:
    """Warning lines about `address`, and how many events they stand for (a summary
    line says how many more it covers)."""
    lines = events = 0
    for record in records:
        text = record.getMessage()
        if record.levelno < logging.WARNING or f" {address}: " not in text:
            continue
        lines += 1
        more = re.search(r": (\d+) more in the last", text)
        events += int(more.group(1)) if more else 1
    return lines, events


async def test_warnings_about_a_peer_are_one_line_per_interval_with_a_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer reconnecting with a bad handshake, or sending bad lines, costs the log one
    line per interval per address: the first at once, then a count."""
    interval = 1.0
    monkeypatch.setattr(tcp_connection, "LOG_INTERVAL", interval)
    caplog.set_level(logging.DEBUG, logger="plait")
    hub_handler = RecordingHandler("hub")
    async with running_hub(hub_handler) as hub:
        started = time.monotonic()
        for _ in range(30):  # reconnecting, with a bad first line each time
            peer = await RawPeer.connect(hub.port)
            await peer.send(b"HELLO there\n")
            assert (await peer.rest())[0].startswith("ERROR expected NAME")
            await peer.close()
        peer = await RawPeer.connect(hub.port)
        await peer.handshake("bad")
        await peer.send(b"RDATA bad bad\n" * 50 + b"POSITION s bad 0 1\n")  # 50 answered
        await eventually(lambda: "POSITION s bad 0 1" in hub_handler.live()[0].lines, "marker")
        other = await RawPeer.connect(hub.port, source="127.0.0.2")
        await other.send(b"HELLO there\n")
        assert (await other.rest())[0].startswith("ERROR expected NAME")
        # Another address is not held back by the first one's flood.
        await eventually(lambda: _counted(caplog.records, "127.0.0.2") == (1, 1), "at once")
        # Every event is counted in the end, in a few lines.
        await eventually(
            lambda: _counted(caplog.records, "127.0.0.1")[1] == 80, "summed up", within=5.0
        )
        lines, _ = _counted(caplog.records, "127.0.0.1")
        assert lines <= 2 + (time.monotonic() - started) / interval
        await peer.close()
        await other.close()
