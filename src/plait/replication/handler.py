"""The replication command handler: one per instance, shared by every connection of
both transports (R-RP-1). The decisions are the pure `Inbound`/`Outbound`; this file
only queues, reads and delivers. Each connection is a `HandlerSession` (`session.py`),
which queues and orders what arrives on it; the handler delivers, catches up, and sends.

Delivery order (R-CA-3): rows to `on_rows` listeners (caches invalidate there), then
the stream advances, then `on_position` listeners, then `wait_for_stream_position`
waiters. Nothing observes a position before the effects of its rows are in place.

Outbound (R-RP-4, R-RP-5): each stream's writer posts to its outbox
(`plait.streams.outbox`), and one `Sender` per stream drains it: after this instance's
own position moves, its rows in (sent, position] go out as RDATA plus a trailing
POSITION, taken from the outbox when the write returned them whole, else read back; the
writers this instance fenced come to `fenced`. An announcer ticks the outboxes every
`announce_interval`, so an idle writer's position still moves for everyone. A new
connection gets REPLICATE and our positions, never old rows.

"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any

from plait.core.commands import (
    Command,
    CommandSet,
    Depart,
    Fenced,
    Position,
    Rdata,
    Replicate,
    command_name,
    to_line,
    with_sign,
)
from plait.core.progress import Progress
from plait.core.throttle import Throttle
from plait.replication.handler_options import HandlerOptions
from plait.replication.link import Link
from plait.replication.listeners import (
    CommandListener,
    DepartureListener,
    Listeners,
    PositionListener,
    ResetListener,
    RowsListener,
    call,
    call_now,
    is_async,
)
from plait.replication.metrics import ReplicationMetrics, StreamSnapshot
from plait.replication.sender import Sender
from plait.replication.session import HandlerSession
from plait.replication.streams import ReplicatedStream
from plait.replication.waiters import PositionWaiters
from plait.tasks import TaskSet, cancel_and_wait

logger = logging.getLogger(__name__)

__all__ = [
    "CommandListener",
    "DepartureListener",
    "Listeners",
    "PositionListener",
    "ReplicationHandler",
    "ResetListener",
    "RowsListener",
]

_DEFAULTS = HandlerOptions()
# One warning per (connection, stream, writer) this often about refused claims; the
# metric counts every one.
_REFUSALS_LOGGED_EVERY = 10.0
# One warning per (connection, stream) this often about overflowing inbound queues.
_OVERFLOWS_LOGGED_EVERY = 10.0


class ReplicationHandler:
    """Feeds the streams of one instance from its connections and sends its own rows."""

    def __init__(
        self,
        instance_name: str,
        streams: Mapping[str, ReplicatedStream],
        *,
        commands: CommandSet,
        listeners: Listeners,
        waiters: PositionWaiters,
        metrics: ReplicationMetrics,
        options: HandlerOptions = _DEFAULTS,
        up_grace: float | None = None,
    ) -> None:
        self._name = instance_name
        self.streams = dict(streams)
        self.commands = commands
        self.listeners = listeners
        self.waiters = waiters
        self.metrics = metrics
        self.announce_interval = options.announce_interval
        self.catch_up_page = options.catch_up_page
        self.catch_up_page_max = options.catch_up_page_max
        self.inbound_queue = options.inbound_queue
        # Configured writers that are not running never answer REPLICATE: past this,
        # a connection is up once every writer that did answer caught up.
        self.up_grace = 2 * self.announce_interval + 1.0 if up_grace is None else up_grace
        self._sessions: list[HandlerSession] = []
        # Sessions whose connection ended while commands still waited: they drain.
        self._draining: set[HandlerSession] = set()
        # Every task of every session: `stop` ends them all.
        self._session_tasks = TaskSet("replication sessions")
        self.stopping = False
        # One per stream: it drains the stream's outbox (own rows, fences).
        self._senders = [Sender(self, stream) for stream in self.streams.values()]
        self._tasks: list[asyncio.Task[None]] = []
        self._unknown_streams: set[str] = set()
        self.sync_streams: set[str] = set()
        # Held while rows of one (stream, writer) are handed over: a fence's catch-up
        # and a connection's RDATA or POSITION for that writer never interleave.
        self._delivering: dict[tuple[str, str], asyncio.Lock] = {}
        self._fence_tasks: set[asyncio.Task[None]] = set()
        # Refused claims and rows that fail to decode, keyed apart.
        self.warnings = Throttle(_REFUSALS_LOGGED_EVERY)
        self._overflows = Throttle(_OVERFLOWS_LOGGED_EVERY)
        metrics.watch_streams(self._snapshots)

    @property
    def instance_name(self) -> str:
        return self._name

    # -- lifetime -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start sending: one task per own stream, and the announcer."""
        # Streams whose listeners are all plain functions get live rows delivered
        # without a task switch (the listeners are fixed from here on).
        self.sync_streams = {
            name
            for name in self.streams
            if not any(
                is_async(listener)
                for listener in (
                    *self.listeners.rows.get(name, ()),
                    *self.listeners.positions.get(name, ()),
                )
            )
        }
        for sender in self._senders:
            self._tasks.append(asyncio.create_task(sender.run(), name=f"plait-send-{sender}"))
        self._tasks.append(asyncio.create_task(self._announce(), name="plait-announce"))

    async def stop(self, *, depart: bool = True) -> None:
        """Send what is left, announce our departure (R-RP-8), end every task (what
        waits in the inbound queues is not handled)."""
        self.stopping = True
        await cancel_and_wait(*self._tasks, *self._fence_tasks)
        self._tasks.clear()
        for sender in self._senders:
            try:
                await sender.close()
            except Exception as err:
                logger.warning("replication: final send of %s failed: %s", sender, err)
        if depart:
            self.broadcast([Depart(self._name)])
        for session in list(self._sessions):
            session.closed()
        await self._session_tasks.aclose()
        self._draining.clear()

    # -- connections --------------------------------------------------------------------

    def open(
        self, link: Link, *, reply_errors: bool, authenticated: bool = False
    ) -> HandlerSession:
        session = HandlerSession(self, link, reply_errors, authenticated)
        self._sessions.append(session)
        self.send_command(link, Replicate())
        self.answer_replicate(link)
        return session

    def forget(self, session: HandlerSession) -> None:
        with contextlib.suppress(ValueError):
            self._sessions.remove(session)

    def own_task(self, task: asyncio.Task[None]) -> None:
        """A session's task: `stop` cancels it and waits for it."""
        self._session_tasks.add(task)

    def drain(self, session: HandlerSession) -> None:
        """`session`'s connection ended with commands waiting: they are handled all the
        same (counted in the inbound queue length until then)."""
        self._draining.add(session)

    def drained(self, session: HandlerSession) -> None:
        self._draining.discard(session)

    def expected_writers(self) -> set[tuple[str, str]]:
        """(stream, writer) pairs that should announce themselves on a new connection."""
        return {
            (name, writer)
            for name, stream in self.streams.items()
            for writer in stream.writers or ()
            if writer != self._name
        }

    def queue_length(self, stream: str) -> int:
        return sum(s.queue_length(stream) for s in (*self._sessions, *self._draining))

    # -- sending ----------------------------------------------------------------------------

    def broadcast(self, commands: Iterable[Command]) -> None:
        """Send commands on every open connection, in order."""
        self.send_lines([to_line(command) for command in commands])

    def send_lines(self, lines: list[str]) -> None:
        """Send command lines on every open connection, in order."""
        metrics = self.metrics
        if len(lines) == 1:
            metrics.child(metrics.commands_out, command_name(lines[0])).inc()
        else:  # a page of rows: one increment per command name
            for name, count in collections.Counter(map(command_name, lines)).items():
                metrics.child(metrics.commands_out, name).inc(count)
        for session in self._sessions:
            for line in lines:
                session.link.send(line)

    def send(self, command: Command) -> None:
        """Send an application command to every peer."""
        self.broadcast([command])

    def send_command(self, link: Link, command: Command) -> None:
        """Send one command on one link, counted in the metrics."""
        self.metrics.child(self.metrics.commands_out, command.NAME).inc()
        link.send(to_line(command))

    def answer_replicate(self, link: Link) -> None:
        """Our position on every stream we write, with nothing in between (R-RP-4)."""
        for sender in self._senders:
            if sender.outbound is not None:
                self.send_command(link, with_sign(sender.outbound.replicate(), sender.stream.sign))

    async def _announce(self) -> None:
        while True:
            await asyncio.sleep(self.announce_interval)
            for sender in self._senders:
                try:
                    sender.announce()
                except Exception:  # one stream's failure must not end every announcement
                    logger.exception("replication: announcing %s failed", sender)

    # -- fenced writers ---------------------------------------------------------------------

    def fenced(self, stream: ReplicatedStream, writer: str, signed: int) -> None:
        """This instance fenced a dead `writer` up to `signed`: tell the others, who
        check the writer's stored position and then catch up its rows as for a POSITION
        from wherever they are, and catch them up here too before its position moves.
        Stopping, it is left alone: no task is started that `stop` would not end."""
        if self.stopping:
            return
        self.broadcast([Fenced(stream.name, writer, signed)])
        task = asyncio.create_task(
            self._catch_up_fenced(stream, writer, stream.sign * signed),
            name=f"plait-fenced-{stream.name}-{writer}",
        )
        self._fence_tasks.add(task)
        task.add_done_callback(self._fence_tasks.discard)

    async def _catch_up_fenced(self, stream: ReplicatedStream, writer: str, token: int) -> None:
        try:
            async with self.delivering(stream.name, writer):
                current = stream.seen(writer)
                if token > current:
                    await self.catch_up(stream, writer, current, token)
        except Exception as err:  # the next fence (or the writer's return) retries
            logger.warning(
                "replication: catching up fenced %s of %s failed: %s", stream.name, writer, err
            )

    def delivering(self, stream: str, writer: str) -> asyncio.Lock:
        """The lock held while rows of `writer` on `stream` are handed over."""
        key = (stream, writer)
        lock = self._delivering.get(key)
        if lock is None:
            lock = self._delivering[key] = asyncio.Lock()
        return lock

    def is_delivering(self, stream: str, writer: str) -> bool:
        lock = self._delivering.get((stream, writer))
        return lock is not None and lock.locked()

    # -- delivering -------------------------------------------------------------------------

    def _delivery(
        self, stream: ReplicatedStream, writer: str, token: int, rows: list[Any]
    ) -> Iterator[tuple[Callable[..., Awaitable[None] | None], tuple[Any, ...]]]:
        """The steps of handing rows of `writer` up to `token` (internal) over, in the
        R-CA-3 order: the listeners to call, one by one; the caller runs each before
        asking for the next, so the stream advances only after every `on_rows`
        listener ran, and waiters go last."""
        name = stream.name
        signed = stream.sign * token
        if rows:
            for listener in self.listeners.rows.get(name, ()):
                yield listener, (name, writer, signed, rows)
        stream.advance(writer, token)
        for position_listener in self.listeners.positions.get(name, ()):
            yield position_listener, (name, writer, signed)
        self.waiters.release(name, writer, stream.seen(writer))

    async def deliver(
        self, stream: ReplicatedStream, writer: str, token: int, rows: list[Any]
    ) -> None:
        """Hand rows over, awaiting `async def` listeners."""
        for listener, args in self._delivery(stream, writer, token, rows):
            await call(listener, *args)

    def deliver_now(
        self, stream: ReplicatedStream, writer: str, token: int, rows: list[Any]
    ) -> None:
        """`deliver` for a stream in `sync_streams`, without awaiting anything."""
        for listener, args in self._delivery(stream, writer, token, rows):
            call_now(listener, *args)

    async def catch_up(
        self, stream: ReplicatedStream, writer: str, from_exclusive: int, to_inclusive: int
    ) -> None:
        """Read and deliver `writer`'s rows in (from, to], a page at a time; only move
        on when nobody here takes rows of a stream whose rows stay in the database
        (a reader of positions alone reads rows itself, if at all)."""
        name = stream.name
        if stream.durable and not self.listeners.rows.get(name):
            await self.deliver(stream, writer, to_inclusive, [])
            return
        low = from_exclusive
        pages = stream.catch_up(
            writer, low, to_inclusive, self.catch_up_page, self.catch_up_page_max
        )
        progress = Progress(
            f"replication: catching up {name} of {writer}", low, to_inclusive, time.monotonic()
        )
        async with contextlib.aclosing(pages):
            async for page in pages:
                if page.reset:
                    logger.info(
                        "replication: %s of %s was reset (its writer restarted)", name, writer
                    )
                    for listener in self.listeners.resets.get(name, ()):
                        await call(listener, name, writer)
                upto = page.upto if page.limited else to_inclusive
                if upto <= low and page.limited:
                    raise RuntimeError(f"catch-up of {name}/{writer} made no progress past {low}")
                self.metrics.catch_up_pages.labels(name).inc()
                self.metrics.catch_up_rows.labels(name).inc(len(page.rows))
                await self.deliver(stream, writer, upto, page.rows)
                low = upto
                if line := progress.step(upto, len(page.rows), time.monotonic()):
                    logger.info("%s", line)
        if low < to_inclusive:  # the source ended early (it should not): never skip ahead
            raise RuntimeError(f"catch-up of {name}/{writer} stopped at {low}, not {to_inclusive}")
        if line := progress.done(time.monotonic()):
            logger.info("%s", line)

    async def departed(self, instance: str) -> None:
        if instance == self._name:
            return
        logger.info("replication: %s departed", instance)
        for listener in self.listeners.departures:
            await call(listener, instance)

    def refuse(
        self, stream: ReplicatedStream, command: Rdata | Position | Fenced, link: str
    ) -> None:
        """A row or position claims an ID the stream's sequence has not handed out, or
        a fence the database does not show: it is dropped, counted and logged
        (rate-limited), never adopted (R-ID-14)."""
        self.metrics.refused_positions.labels(stream.name).inc()
        held = self.warnings.allow((link, stream.name, command.instance), time.monotonic())
        if held is None:
            return
        if isinstance(command, Fenced):
            why = (
                f"{command.instance}'s stored position is below {command.position}, so no fence "
                "moved it there: the announcement is forged, or comes from another "
                "database (every instance must use the same database)"
            )
        else:
            claim = command.token if isinstance(command, Rdata) else command.new
            why = (
                f"{claim} names no ID yet (above the sequence head), so it is forged or "
                "comes from another database; every instance must use the same database"
            )
        logger.warning(
            "replication: refused %s of %s for %s on %s: %s%s",
            command.NAME,
            command.instance,
            stream.name,
            link,
            why,
            f" ({held} more refused since the last warning)" if held else "",
        )

    def overflowed(self, stream: ReplicatedStream, link: str) -> None:
        """A stream's inbound queue on `link` passed `inbound_queue`: its commands were
        dropped for a catch-up from the source; counted, and logged rate-limited."""
        self.metrics.inbound_overflows.labels(stream.name).inc()
        held = self._overflows.allow((link, stream.name), time.monotonic())
        if held is None:
            return
        source = "the database" if stream.durable else "its writers over HTTP"
        logger.warning(
            "replication: more than %d commands of %s waited on %s (replication.inbound_queue): "
            "its listeners (or its catch-ups) are slower than its writers; dropped them and "
            "catching up from %s instead%s",
            self.inbound_queue,
            stream.name,
            link,
            source,
            f" ({held} more times since the last warning)" if held else "",
        )

    def stream(self, name: str) -> ReplicatedStream | None:
        stream = self.streams.get(name)
        if stream is None and name not in self._unknown_streams:
            self._unknown_streams.add(name)
            logger.info("replication: ignoring commands for stream %r, not replicated here", name)
        return stream

    def _snapshots(self) -> list[StreamSnapshot]:
        return [
            StreamSnapshot(
                name,
                s.positions(),
                s.persisted_upto(),
                self.queue_length(name),
                own_writer=None if s.own_position() is None else self._name,
                oldest_unfinished_age=s.oldest_unfinished_age() or 0.0,
            )
            for name, s in self.streams.items()
        ]
