"""Hostile and broken peers on the TCP hub, while two instances replicate through it.

The hub is instance w1; w2 is a client; both write rows all the time. A bare socket
peer then misbehaves: garbage, an endless line, a flood, a peer that never reads, many
half-closed connections, a peer that never says NAME. Each time the peer is cut off
within a bound, what the hub holds for its peers stays bounded, and w1 and w2 go on
replicating: every row once, in order, with bounded latency, and w2's connection never
drops. Nothing is mocked: real PostgreSQL, real sockets, real instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import pace
from pace import slowness
from plait import Database
from plait.core import tcp_protocol
from plait.core.commands import MAX_LINE_BYTES
from plait.errors import ConfigError
from plait.instance import Instance
from plait.replication.tcp_transport import TcpHub
from replication_helpers import Cluster, Seen, cluster_of, metric, start_connected, write

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
SEND_QUEUE = 1000  # lines queued for one peer at the hub before it counts as too slow
LATENCY_BOUND = 1.0  # seconds from commit to the other instance, at worst, under attack
# Seconds from the start of an attack until the peer is cut off: one found out by what it
# sends, at once (not left to a timeout, such as the hub's close grace of 1 s); one found
# out over time (a full queue, the handshake timeout), within this.
CUT_AT_ONCE = 0.5
CUT_OFF_BOUND = 3.0
STALL_BOUND = 0.25  # seconds the event loop (the hub's, w1's and w2's) is held, at worst
# The bounds above are a quiet machine's: each test runs twice, on them as written
# (marked `timing`: CI's quiet machine) and on them times this machine's slowness now
# (the default run: a busy laptop holds an event loop longer without a fault of plait's).
PACE = 1.0


@pytest.fixture(autouse=True, params=["busy", pytest.param("quiet", marks=pytest.mark.timing)])
def _pace(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(globals(), "PACE", slowness() if request.param == "busy" else 1.0)


# -- two instances replicating through the hub ----------------------------------------


@dataclass
class Arrivals(Seen):
    """Rows one instance received (one per ID, as `write` makes them), and when each
    ID first arrived."""

    at: dict[int, float] = field(default_factory=dict)

    def on_rows(self, stream: str, writer: str, token: int, rows: list[Any]) -> None:
        now = time.monotonic()
        for row in rows:
            self.at.setdefault(row[1], now)
        super().on_rows(stream, writer, token, rows)

    @property
    def ids(self) -> list[int]:
        return [row[1] for row in self.rows]


@dataclass
class Pair:
    """w1 (the hub) and w2, each writing a row every `interval` while `traffic` runs."""

    cluster: Cluster
    w1: Instance
    w2: Instance
    at_w1: Arrivals
    at_w2: Arrivals
    written: dict[str, list[int]] = field(default_factory=lambda: {"w1": [], "w2": []})
    committed_at: dict[int, float] = field(default_factory=dict)

    @property
    def hub(self) -> TcpHub:
        transport = self.w1._transport
        assert isinstance(transport, TcpHub)
        return transport

    async def write_rows(self, until: asyncio.Event, body: int, interval: float = 0.01) -> None:
        """A row on each writer every `interval`, with a payload of `body` bytes."""
        i = 0
        padding = "x" * body
        while not until.is_set():
            for name, instance in (("w1", self.w1), ("w2", self.w2)):
                stream_id = await write(instance, f"{name}-{i}-{padding}")
                self.committed_at[stream_id] = time.monotonic()
                self.written[name].append(stream_id)
            i += 1
            await asyncio.sleep(interval)

    async def check_replication(self) -> None:
        """Every row of one writer reached the other once, in order, in time; w2's
        connection to the hub never dropped."""
        await self.at_w2.wait(len(self.written["w1"]), within=10)
        await self.at_w1.wait(len(self.written["w2"]), within=10)
        await asyncio.sleep(0.3)  # nothing repeated later either
        assert self.at_w2.ids == self.written["w1"]
        assert self.at_w1.ids == self.written["w2"]
        latencies = [
            arrivals.at[i] - self.committed_at[i]
            for arrivals in (self.at_w1, self.at_w2)
            for i in arrivals.ids
        ]
        assert max(latencies) < LATENCY_BOUND * PACE, sorted(latencies)[-5:]
        reconnects = metric(self.w2, "plait_reconnects_total", link="tcp:hub")
        assert not reconnects, "w2 lost its connection to the hub"
        assert len(self.w2_sessions_at_hub()) == 1

    def w2_sessions_at_hub(self) -> list[Any]:
        return [p for p in self.hub._peers if p.label == "tcp:w2"]

    def buffered(self) -> float:
        """Bytes the hub holds for its peers: queued lines, unsent and unread bytes (its
        gauge, read as a scrape would)."""
        return metric(self.w1, "plait_tcp_hub_buffered_bytes")


@contextlib.asynccontextmanager
async def replicating(
    db: Database, *, secret: str | None = None, **tcp_settings: Any
) -> AsyncIterator[Pair]:
    async with cluster_of(db, "tcp", hub="w1") as cluster:
        tcp = {"hub": "w1", "port": cluster.hub_port, "send_queue": SEND_QUEUE, **tcp_settings}
        at_w1, at_w2 = Arrivals(), Arrivals()
        arrivals = {"w1": at_w1, "w2": at_w2}
        replication = {"tcp": tcp, "secret": secret}
        w1, w2 = await start_connected(cluster, arrivals, replication=replication)
        yield Pair(cluster, w1, w2, at_w1, at_w2)


async def under_attack(
    pair: Pair,
    attack: Callable[[int], Awaitable[float]],
    *,
    memory_bound: int,
    cut_within: float = CUT_OFF_BOUND,
    body: int = 10,
) -> float:
    """Run `attack(port)` (it returns how long until the hub cut it off) while both
    instances write rows of `body` bytes; watch the hub's buffers and how long the event
    loop is held (the hostile peer runs in it too: it must yield as another process
    would); then check replication."""
    stop = asyncio.Event()
    peak = 0.0  # bytes, read from a gauge
    stall = 0.0  # the longest the event loop was held, past the watcher's own pause

    async def watch() -> None:
        nonlocal peak, stall
        while not stop.is_set():
            peak = max(peak, pair.buffered())
            before = time.monotonic()
            await asyncio.sleep(0.005)
            stall = max(stall, time.monotonic() - before - 0.005)

    writing = asyncio.create_task(pair.write_rows(stop, body))
    watching = asyncio.create_task(watch())
    try:
        await asyncio.sleep(0.2)
        cut_after = await attack(pair.hub.port)
        await asyncio.sleep(0.3)  # traffic after the attack flows too
    finally:
        stop.set()
        await asyncio.gather(writing, watching)
    assert cut_after < cut_within * PACE, f"cut off only after {cut_after:.2f}s"
    assert peak < memory_bound, f"the hub held {peak} bytes for its peers"
    assert stall < STALL_BOUND * PACE, f"the event loop was held for {stall:.2f}s"
    await pair.check_replication()
    return cut_after


# -- a hostile peer ------------------------------------------------------------------


class Hostile:
    """A bare connection to the hub."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.started = time.monotonic()
        self.received = bytearray()

    @classmethod
    async def connect(cls, port: int, *, name: str | None = "hostile") -> Hostile:
        reader, writer = await asyncio.open_connection(HOST, port)
        peer = cls(reader, writer)
        if name is not None:
            writer.write(f"NAME {name}\n".encode())
            line = await reader.readline()
            assert line.startswith(b"SERVER "), line
        peer.started = time.monotonic()
        return peer

    async def send_until_cut(self, chunks: Callable[[], bytes], *, read: bool = True) -> float:
        """Send chunk after chunk until the hub hangs up (reading what it sends, unless
        not `read`); seconds until then."""
        reading = asyncio.create_task(self._read()) if read else None
        try:
            async with pace.bounded((CUT_OFF_BOUND + 2) * PACE, "the hub to cut the peer off"):
                while True:
                    if reading is not None and reading.done():
                        break
                    try:
                        self.writer.write(chunks())
                        await self.writer.drain()
                    except (ConnectionError, OSError):
                        break
                    # drain() returns without yielding while the kernel takes the bytes:
                    # yield, as a peer in another process would not hold our event loop.
                    await asyncio.sleep(0)
            return time.monotonic() - self.started
        finally:
            if reading is not None:
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading
            self.writer.transport.abort()

    async def _read(self) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await self.reader.read(1 << 16):
                self.received += chunk

    def lines(self) -> list[bytes]:
        return bytes(self.received).split(b"\n")

    def close(self) -> None:
        self.writer.transport.abort()


def errors_of(peer: Hostile) -> list[bytes]:
    return [line for line in peer.lines() if line.startswith(b"ERROR")]


# -- 1. garbage ----------------------------------------------------------------------


def random_junk() -> bytes:
    """Random bytes ending in a line break, of which no line is one the hub relays: about
    one call in a hundred would otherwise hold a well-formed application command (a
    lone "Y"), which the hub relays by design, for its receivers to judge."""
    while True:
        raw = os.urandom(random.randint(1, 200))
        if not any(_relayed(line) for line in raw.split(b"\n")):
            return raw + b"\n"


def _relayed(line: bytes) -> bool:
    try:
        text = line.removesuffix(b"\r").decode()
    except UnicodeDecodeError:
        return False
    return tcp_protocol.ClientLines.relayed(text, answered_error=True)


def garbage() -> bytes:
    """Random bytes, invalid UTF-8, lines with no command name, built-in commands with
    bad arguments, rows in the hub's name, empty lines. (A well-formed name the hub does
    not know may be an application's command: relayed, for its receivers to check.)"""
    kinds: list[Callable[[], bytes]] = [
        random_junk,
        lambda: b"RDATA \xff\xfe\xfd events\n",
        lambda: b"hello lower case %d\n" % random.randint(0, 10**6),
        lambda: b"DEPART\n",
        lambda: b"RDATA events w1 notanumber {\n",
        lambda: b"POSITION events w2 x y\n",
        lambda: b"\n",
        lambda: b"\x00\x00\x00\n",
    ]
    return b"".join(random.choice(kinds)() for _ in range(50))


async def test_a_peer_sending_garbage_is_cut_off_and_none_of_it_reaches_others(
    db: Database,
) -> None:
    async with replicating(db) as pair:

        async def attack(port: int) -> float:
            peer = await Hostile.connect(port)
            cut = await peer.send_until_cut(garbage)
            errors = errors_of(peer)
            assert len(errors) > 50  # each bad line answered, up to the budget
            assert errors[-1].startswith(b"ERROR too many bad lines"), errors[-1]
            return cut

        await under_attack(pair, attack, memory_bound=8 << 20, cut_within=CUT_AT_ONCE)
        # nothing of it was relayed
        assert metric(pair.w2, "plait_bad_command_lines_total", link="tcp:hub") == 0


# -- 2. an endless line ----------------------------------------------------------


@pytest.mark.parametrize("named", [True, False], ids=["after NAME", "instead of NAME"])
async def test_an_endless_line_is_cut_off_at_the_line_limit(db: Database, named: bool) -> None:
    async with replicating(db) as pair:

        async def attack(port: int) -> float:
            peer = await Hostile.connect(port, name="endless" if named else None)
            sent = 0

            def chunk() -> bytes:
                nonlocal sent
                sent += 1 << 16
                return b"x" * (1 << 16)

            cut = await peer.send_until_cut(chunk)
            assert errors_of(peer)[-1].startswith(b"ERROR line too long"), peer.lines()[-2:]
            assert sent < 4 * MAX_LINE_BYTES  # stopped at the limit, not when the peer gave up
            return cut

        # One line's worth in the reader's buffer, and little else. (Instead of NAME, the
        # peer is not yet among those the hub counts: only the others' share is checked.)
        await under_attack(pair, attack, memory_bound=3 * MAX_LINE_BYTES, cut_within=CUT_AT_ONCE)


# -- 3. floods -----------------------------------------------------------------------


def misbehaving_flood() -> bytes:
    """Lines a well-behaved peer sends once or never: NAME again, REPLICATE over and
    over, ERRORs; with PINGs and valid lines the hub relays in between."""
    lines = [
        b"NAME again\n",
        b"REPLICATE\n",
        b"ERROR you are wrong\n",
        b"PING 1\n",
        b"POSITION events hostile 0 1\n",
    ]
    return b"".join(lines * 200)


async def test_a_peer_flooding_repeats_of_what_is_sent_once_is_cut_off(db: Database) -> None:
    async with replicating(db) as pair:
        replicates_before = replicates_at(pair.w2)

        async def attack(port: int) -> float:
            peer = await Hostile.connect(port)
            cut = await peer.send_until_cut(misbehaving_flood)
            assert errors_of(peer)[-1].startswith(b"ERROR too many bad lines")
            return cut

        await under_attack(pair, attack, memory_bound=8 << 20, cut_within=CUT_AT_ONCE)
        # Only the first few REPLICATEs were relayed (each one makes every instance
        # announce every position to everyone); the rest were dropped at the hub.
        relayed = replicates_at(pair.w2) - replicates_before
        assert relayed == tcp_protocol.REPLICATE_FREE


def replicates_at(instance: Instance) -> float:
    return metric(instance, "plait_commands_received_total", command="REPLICATE")


async def test_a_flood_of_valid_lines_does_not_starve_the_others(db: Database) -> None:
    """Lines the hub must relay (the peer, a writer nobody follows, moving on): not bad in
    themselves, so the peer is not cut off; the hub's reader yields to the others."""
    async with replicating(db) as pair:
        w1_before, w2_before = position_lines_at(pair.w1), position_lines_at(pair.w2)
        relayed = 0

        async def attack(port: int) -> float:
            nonlocal relayed
            peer = await Hostile.connect(port)
            reading = asyncio.create_task(peer._read())
            deadline = time.monotonic() + 1.5
            position = 0
            while time.monotonic() < deadline:
                chunk = b"".join(
                    b"POSITION events hostile %d %d\n" % (position + i, position + i + 1)
                    for i in range(500)
                )
                position += 500
                # No yield beyond drain(): the hub's buffer fills, as it would from a
                # peer in another process, and the hub's reader must yield itself.
                peer.writer.write(chunk)
                await peer.writer.drain()
            relayed = position
            assert not reading.done(), "the hub cut off a peer sending valid lines"
            reading.cancel()
            peer.close()
            return 0.0

        await under_attack(pair, attack, memory_bound=16 << 20)
        taken = position_lines_at(pair.w1) - w1_before  # the rest was cut off unread
        assert taken > 10_000 / PACE, (taken, relayed)
        # each one relayed, and nothing else (the instances' own lines count a few)
        assert 0 <= position_lines_at(pair.w2) - w2_before - taken < 100


def position_lines_at(instance: Instance) -> float:
    return metric(instance, "plait_commands_received_total", command="POSITION")


async def test_a_peer_that_never_reads_is_cut_off_once_its_queue_is_full(
    db: Database,
) -> None:
    async with replicating(db, send_queue=50) as pair:
        loop = asyncio.get_running_loop()

        async def attack(port: int) -> float:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, (HOST, port))
                await loop.sock_sendall(sock, b"NAME sleeper\n")
                started = time.monotonic()
                # It reads nothing from here on, but pings (a silent peer would be cut
                # off by dead_after instead), while the rows pile up for it at the hub.
                limit = (CUT_OFF_BOUND + 2) * PACE
                async with pace.bounded(limit, "the hub to cut off the peer that reads nothing"):
                    while True:
                        try:
                            await loop.sock_sendall(sock, b"PING 1\n")
                        except OSError:
                            break
                        await asyncio.sleep(0.05)
                return time.monotonic() - started
            finally:
                sock.close()

        await under_attack(pair, attack, memory_bound=16 << 20, body=64_000)


# -- 4. many connections -------------------------------------------------------------


async def test_many_connections_that_half_close_or_never_say_name_are_all_cut_off(
    db: Database,
) -> None:
    async with replicating(db, handshake_timeout=0.5) as pair:

        async def one(port: int, number: int) -> float:
            # In waves, as the hub's listen backlog (1024) is capped by the kernel's
            # somaxconn, which may be as low as 128: past it, connections wait unaccepted
            # for SYN-ACK retries, where no hub can see them.
            await asyncio.sleep(0.05 * (number // 25))
            kind = number % 5
            reader, writer = await asyncio.open_connection(HOST, port)
            started = time.monotonic()
            try:
                if kind == 0:  # NAME, then half-closed at once
                    writer.write(b"NAME half%d\n" % random.randint(0, 10**9))
                    writer.write_eof()
                elif kind == 1:  # half-closed in the middle of NAME
                    writer.write(b"NAM")
                    writer.write_eof()
                elif kind == 2:  # half-closed without a word
                    writer.write_eof()
                elif kind == 3:  # NAME a byte at a time, too slowly
                    for byte in b"NAME slow\n":
                        writer.write(bytes([byte]))
                        await asyncio.sleep(0.1)
                        if reader.at_eof():
                            break
                # kind 4: connects and says nothing
                limit = (CUT_OFF_BOUND + 2) * PACE
                async with pace.bounded(limit, f"the hub to hang up on bad handshake {kind}"):
                    while await reader.read(1 << 16):
                        pass
                return time.monotonic() - started
            except (ConnectionError, OSError):
                return time.monotonic() - started
            finally:
                writer.transport.abort()

        async def attack(port: int) -> float:
            cuts = await asyncio.gather(*(one(port, i) for i in range(300)))
            return max(cuts)

        await under_attack(pair, attack, memory_bound=8 << 20)
        assert pair.hub._handshaking == 0
        assert {p.label for p in pair.hub._peers} == {"tcp:w2"}


# -- 5. a peer speaking for others ---------------------------------------------------


@pytest.mark.parametrize("secret", [None, "s3cret"], ids=["no secret", "with a secret"])
async def test_a_peer_cannot_move_another_writers_position_or_send_its_rows(
    db: Database, secret: str | None
) -> None:
    """The issue's attack: a peer says NAME evil, then sends a position and a row of w2.
    Neither reaches w1 (the hub) nor w2: without a secret the hub refuses lines in any
    name but the connection's; with one, the peer never gets past the handshake."""
    async with replicating(db, secret=secret) as pair:

        async def attack(port: int) -> float:
            reader, writer = await asyncio.open_connection(HOST, port)
            try:
                writer.write(b"NAME evil\n")
                first = await reader.readline()
                assert first.startswith(b"CHALLENGE w1 " if secret else b"SERVER w1"), first
                row = b'["events", 1000000000, "w2", "forged"]'
                writer.write(
                    b"POSITION events w2 0 1000000000\n"
                    b"RDATA events w2 1000000000 " + row + b"\n"
                    b"POSITION notes w2 0 1000000000\n"
                )
                errors: list[bytes] = []
                async with pace.bounded(CUT_OFF_BOUND * PACE, "the hub's ERROR lines"):
                    while len(errors) < 3 and (line := await reader.readline()):
                        if line.startswith(b"ERROR"):
                            errors.append(line)
                if secret:
                    assert errors == [b"ERROR expected PROOF <nonce> <proof>, got POSITION\n"]
                else:
                    assert all(b" of w2 refused: this connection is evil" in e for e in errors)
                    assert len(errors) == 3
                return 0.0
            finally:
                writer.transport.abort()

        await under_attack(pair, attack, memory_bound=8 << 20)
        for stream in ("events", "notes"):
            seen = metric(pair.w1, "plait_stream_position", stream=stream, writer="w2")
            assert seen < 1_000_000, f"w1 took w2's position on {stream} to be {seen}"
        refused = "auth" if secret else "impersonation"
        assert metric(pair.w1, "plait_tcp_hub_refused_total", reason=refused) >= 1


async def test_a_hub_listening_off_loopback_without_a_secret_refuses_to_start(
    db: Database,
) -> None:
    async with cluster_of(db, "tcp", hub="w1") as cluster:
        tcp = {"hub": "w1", "host": "0.0.0.0", "port": cluster.hub_port}
        instance = cluster.instance("w1", replication={"tcp": tcp})
        try:
            with pytest.raises(ConfigError, match=r"replication\.secret"):
                await instance.start()
        finally:
            await instance.stop()


async def test_a_reconnecting_peer_sending_garbage_does_not_flood_the_log(
    db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 6: every bad line was a warning; now one line per interval per address."""
    caplog.set_level(logging.WARNING, logger="plait")
    async with replicating(db) as pair:

        async def attack(port: int) -> float:
            for _ in range(20):
                peer = await Hostile.connect(port)
                peer.writer.write(b"POSITION events hostile x y\n" * 20)
                await peer.writer.drain()
                async with pace.bounded(CUT_OFF_BOUND * PACE, "20 ERROR lines from the hub"):
                    while len(errors_of(peer)) < 20:
                        chunk = await peer.reader.read(1 << 16)
                        assert chunk, "the hub hung up"
                        peer.received += chunk
                peer.close()
            return 0.0

        caplog.clear()
        await under_attack(pair, attack, memory_bound=8 << 20)
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) <= 5, warnings[:10]
