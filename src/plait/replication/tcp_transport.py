"""TCP replication transport: a hub on one instance, clients on the others (R-RP-1).

This module is the asyncio shell of the hub (accepting, its handshake, relaying) and
`tcp_client` the client's (connecting, its handshake); one established connection is
`tcp_connection.Connection`. What
to do with the bytes and lines (framing, both handshakes, the hub's rules for a client's
lines and its bad-line budget, keepalive decisions) is decided by the pure state
machines of `plait.core.tcp_protocol`. The rules the three keep together:
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
  every `_YIELD_EVERY` lines (`tcp_connection`: a flood must not starve the other
  connections); bad lines (those not relayed above, handshake commands again,
  REPLICATEs past the first few) draw on a budget of `BAD_LINES_BURST` plus
  `BAD_LINES_PER_SECOND` (`tcp_protocol`), past which the client gets ERROR and is
  closed. At most `_MAX_HANDSHAKING_PER_ADDRESS` connections
  from one address, and `_MAX_HANDSHAKING` in all, wait in the handshake at once; more
  are refused on the spot, so one address cannot lock the others out. Warnings about a
  peer (bad lines, ERRORs, failed handshakes) take at most one log line per
  `LOG_INTERVAL` per address: the first at once, then a count.
- `Link.send` never waits: a connection queues at most `send_queue` lines (and
  `MAX_BUFFERED_BYTES`) for its writer task. A peer too slow to keep up gets ERROR and
  is closed (it catches up after reconnecting); lines sent to a closed connection are
  dropped. With the framer's one line and the stream reader's flow control (it stops
  reading the socket past `2 x READ_LIMIT` unread), what the hub holds for one peer
  stays bounded whatever it sends or fails to read.
- Each end sends PING every `ping_interval` and closes a peer silent for `dead_after`.
- Every task and timer is owned: a connection's reader, writer, pinger and wait_up
  watcher end when it closes; the hub and the client end their connections, and their
  log timers, in `stop()`.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import secrets

from plait.core.commands import Error, command_name, to_line
from plait.core.tcp_handshake import Accepted, HubHandshake, Refused, TellHub
from plait.core.tcp_protocol import Admit, ClientLines, encode
from plait.errors import ConfigError
from plait.ports import is_loopback
from plait.replication.link import Handler, Session
from plait.replication.metrics import ReplicationMetrics
from plait.replication.tcp_connection import (
    READ_LIMIT,
    Connection,
    Lines,
    LineTooLongError,
    PeerHungUpError,
    PeerLog,
    close_stream,
    tell_closed,
)
from plait.replication.tcp_options import TcpOptions
from plait.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# Connections in the handshake at once, from one address and from all; more are refused
# on the spot, so that sockets that never finish the handshake cannot pile up (each is
# also cut at the handshake timeout), and one address cannot take every slot.
_MAX_HANDSHAKING_PER_ADDRESS = 8
_MAX_HANDSHAKING = 256
# Random bytes in each nonce of the handshake.
NONCE_BYTES = 16
# Connections the kernel may hold for the hub to accept (asyncio's default is 100): a
# burst past it (every client reconnecting at once, or a flood) leaves connections
# established for the client but unseen by the hub, for seconds of SYN-ACK retries.
_BACKLOG = 1024


def check_secret(secret: str | None) -> bytes | None:
    if secret is None:
        return None
    if not isinstance(secret, str) or not secret:
        raise ConfigError(
            "tcp transport: replication.secret must be a non-empty string; leave it out to "
            "turn authentication off (the hub then listens on loopback only)"
        )
    return secret.encode()


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


class TcpHub:
    """Accepts clients and relays commands between them; this instance's handler serves
    each client connection as it would any other. With a `secret`, clients must prove
    they hold it (and the hub proves it to them); without one, the hub listens on a
    loopback address only. `stop()` closes every connection and ends every task the
    hub started."""

    def __init__(
        self,
        handler: Handler,
        options: TcpOptions,
        *,
        secret: str | None = None,
        metrics: ReplicationMetrics | None = None,
    ) -> None:
        self._options = options
        self._handler = handler
        self._host = options.host
        self._port = options.port
        self._handshake_timeout = options.handshake_timeout
        self._secret = check_secret(secret)
        self._metrics = metrics
        self._server: asyncio.Server | None = None
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()  # one per accepted connection
        self._peers: set[Connection] = set()  # past the handshake: the relay set
        self._handshaking = 0  # connections accepted and not past the handshake yet
        self._handshaking_from: dict[str, int] = {}  # the same, by source address
        self._log = PeerLog("tcp hub", log)
        # While our session takes a client's line: what the handler sends meanwhile,
        # to go out after the relay of that line (see `_deliver`).
        self._held: list[tuple[Connection, str]] | None = None

    @property
    def port(self) -> int:
        """The port listened on (the bound one when started with port 0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("TcpHub: not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def buffered_bytes(self) -> int:
        """Bytes held for the connected peers (see `Connection.buffered_bytes`)."""
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
            self._accept, self._host, self._port, limit=READ_LIMIT, backlog=_BACKLOG
        )
        if self._metrics is not None:
            self._metrics.hub_buffered_bytes.set_function(self.buffered_bytes)
        name = self._handler.instance_name
        auth = "clients prove replication.secret" if self._secret else "no secret: loopback only"
        log.info("tcp hub %s: listening on %s:%d (%s)", name, self._host, self.port, auth)

    async def stop(self) -> None:
        """Stop listening, close every connection (flushing what is queued, each given at
        most `CLOSE_GRACE` seconds) and end every task; sessions see `closed()`."""
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
        writer.write(encode([to_line(Error(text))]))
        writer.close()  # after the ERROR is written; no task needed

    async def _serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: object,
        source: str,
    ) -> None:
        conn: Connection | None = None
        refused = False
        lines = Lines(reader)
        try:
            try:
                name = await self._handshake(lines, writer, source)
            finally:
                self._handshaking -= 1
                if self._handshaking_from[source] > 1:
                    self._handshaking_from[source] -= 1
                else:
                    del self._handshaking_from[source]
            if name is None:
                refused = True
                return
            conn = Connection(
                lines,
                writer,
                name=name,
                label=f"tcp:{name}",
                options=self._options,
                complain=functools.partial(self._log.warn, source),
                hold=self._hold,
                refused=self._count,
                rules=ClientLines(
                    self._handler.instance_name, name, asyncio.get_running_loop().time()
                ),
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
                tell_closed(session, conn.label)
                self._connection_down(conn)
        except Exception:
            log.exception("tcp hub: the connection from %s failed", peer)
        finally:
            if conn is not None:
                await conn.aclose()
            else:  # a refused peer should still read its ERROR
                await close_stream(reader, writer, linger=refused)

    async def _handshake(
        self, lines: Lines, writer: asyncio.StreamWriter, source: str
    ) -> str | None:
        """The client's name once the handshake succeeded (`HubHandshake`); None once it
        failed (the client answered ERROR, unless it hung up or gave up itself)."""
        nonce = secrets.token_hex(NONCE_BYTES)
        shake = HubHandshake(self._handler.instance_name, self._secret, nonce)
        done: Accepted | Refused | TellHub | None = None
        try:
            async with asyncio.timeout(self._handshake_timeout):
                while done is None:
                    step = shake.receive(await lines.next())
                    if step.send:
                        writer.write(encode(step.send))
                    done = step.done
        except TimeoutError:
            done = shake.timed_out(self._handshake_timeout)
        except LineTooLongError:
            done = shake.too_long()
        except (PeerHungUpError, OSError) as err:
            log.debug("tcp hub: %s hung up in the handshake: %r", source, err)
            return None
        if isinstance(done, Accepted):
            return done.name
        assert isinstance(done, Refused)  # the hub never tells itself anything
        self._count(done.reason)
        who = "a connection" if shake.name is None else shake.name
        self._log.warn(source, f"refusing {who}: {done.text}")
        writer.write(encode([to_line(Error(done.text))]))
        return None

    def _deliver(self, sender: Connection, session: Session, line: str | bytes) -> None:
        """Give a client's line to our session, then relay it to every other client as
        the client's `ClientLines` say; what the handler sent meanwhile goes out after
        the relay. Lines in another instance's name are refused before either; they,
        bad lines and surplus REPLICATEs (dropped) draw on the sender's budget."""
        rules = sender.rules
        assert rules is not None  # every client connection of the hub has them
        admit = rules.admit(line)
        if admit is Admit.REFUSE:
            sender.send(to_line(Error(rules.refusal)))
            sender.bad_line("impersonation")
            return
        if admit is Admit.DROP:
            sender.bad_line()
            return
        held: list[tuple[Connection, str]] = []
        self._held = held
        try:
            session.received(line)
        except Exception:  # the session promises not to raise: a bug
            log.exception("%s: the session failed on a line", sender.label)
        finally:
            self._held = None
        answered = any(conn is sender and command_name(out) == Error.NAME for conn, out in held)
        if not ClientLines.relayed(line, answered):
            sender.bad_line()
        elif isinstance(line, str):
            for peer in self._peers:
                if peer is not sender:
                    peer.send(line)
        for conn, out in held:
            conn.send(out)

    def _hold(self, conn: Connection, line: str) -> bool:
        if self._held is None:
            return False
        self._held.append((conn, line))
        return True

    def _count(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.child(self._metrics.tcp_hub_refused, reason).inc()

    def _connection_up(self, conn: Connection) -> None:
        log.info("tcp hub: %s is up (every stream caught up)", conn.label)
        if self._metrics is not None:
            self._metrics.connection_up.labels(link=conn.label).set(1)

    def _connection_down(self, conn: Connection) -> None:
        # A client that reconnected before its old connection was found dead has the
        # same label: its gauge belongs to the newer connection.
        if self._metrics is not None and all(p.label != conn.label for p in self._peers):
            self._metrics.connection_up.labels(link=conn.label).set(0)
