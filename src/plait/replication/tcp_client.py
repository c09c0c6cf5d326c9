"""The TCP transport's client: connects to the hub, proves itself, reconnects after a
growing delay. The rules it keeps with the hub are in `tcp_transport`'s docstring."""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets

from plait.core.backoff import Backoff
from plait.core.commands import Error, to_line
from plait.core.tcp_handshake import Accepted, ClientHandshake, Refused, TellHub
from plait.core.tcp_protocol import encode
from plait.replication.link import Handler, wait_set
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
from plait.replication.tcp_transport import NONCE_BYTES, check_secret
from plait.tasks import cancel_and_wait

log = logging.getLogger("plait.replication.tcp_transport")  # what operators filter on


class TcpClient:
    """Keeps one connection to a hub, reconnecting with backoff forever until `stop()`.
    The backoff starts over only once the handler's session says every stream caught up
    (R-RP-3), so a connection that fails before that never reconnects in a tight loop.
    With a `secret` it proves it holds it, and opens only once the hub proved it too."""

    def __init__(
        self,
        handler: Handler,
        options: TcpOptions,
        *,
        secret: str | None = None,
        backoff: Backoff | None = None,
        metrics: ReplicationMetrics | None = None,
    ) -> None:
        self._options = options
        self._handler = handler
        self._host = options.host
        self._port = options.port
        self._connect_timeout = options.connect_timeout
        self._secret = check_secret(secret)
        self._backoff = backoff if backoff is not None else Backoff()
        self._metrics = metrics
        self._task: asyncio.Task[None] | None = None
        self._open = asyncio.Event()
        self._log = PeerLog("tcp client", log)

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
                    self._host, self._port, limit=READ_LIMIT
                )
        except TimeoutError:
            return f"no connection within {self._connect_timeout:g}s"
        except OSError as err:
            return f"cannot connect: {err}"
        conn: Connection | None = None
        told = False  # we sent the hub ERROR: it should read it before we hang up
        lines = Lines(reader)
        try:
            done = await self._handshake(lines, writer)
            if isinstance(done, str):
                return done
            if isinstance(done, TellHub):
                writer.write(encode([to_line(Error(done.to_hub))]))
                told = True
                return done.text
            if isinstance(done, Refused):
                return done.text
            hub = done.name
            log.info("tcp client: connected to hub %s at %s:%d", hub, self._host, self._port)
            conn = Connection(
                lines,
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
                tell_closed(session, self.label)
                if self._metrics is not None:
                    self._metrics.connection_up.labels(link=self.label).set(0)
        except Exception as err:
            log.exception("tcp client: the connection to the hub failed")
            return f"failed: {err!r}"
        finally:
            if conn is not None:
                await conn.aclose()
            else:
                await close_stream(reader, writer, linger=told)

    async def _handshake(
        self, lines: Lines, writer: asyncio.StreamWriter
    ) -> Accepted | Refused | TellHub | str:
        """How the handshake (`ClientHandshake`) ended, or why it could not (a string:
        the hub hung up, timed out, or sent a line over the limit)."""
        nonce = secrets.token_hex(NONCE_BYTES)
        shake = ClientHandshake(self._handler.instance_name, self._secret, nonce)
        writer.write(encode([shake.start()]))
        try:
            async with asyncio.timeout(self._connect_timeout):
                while True:
                    step = shake.receive(await lines.next())
                    if step.send:
                        writer.write(encode(step.send))
                    if step.done is not None:
                        return step.done
        except TimeoutError:
            return f"the handshake with the hub did not finish within {self._connect_timeout:g}s"
        except LineTooLongError:
            return "the hub sent a line over the limit"
        except PeerHungUpError:
            return "the hub hung up during the handshake"
        except OSError as err:
            return f"the handshake failed: {err}"

    def _connection_up(self) -> None:
        log.info("tcp client: the connection to the hub is up (every stream caught up)")
        self._backoff.up()
        if self._metrics is not None:
            self._metrics.connection_up.labels(link=self.label).set(1)
