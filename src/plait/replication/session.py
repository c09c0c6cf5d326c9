"""One connection as the replication handler serves it (`HandlerSession`): what arrives
is parsed, checked and queued per stream, and handled in order; delivering and catching
up are the handler's (`SessionHost`).

Inbound (R-RP-2, R-RP-3): each connection has one serial queue per stream, so a slow
catch-up on one stream holds up no other. What a command does once its turn comes, and
when the connection counts as up, is `following.py`'s. A failure while handling a
command closes the connection and the command is tried again (`retries.py`). A
connection that ends leaves what it brought to be handled all the same: its writer may
have departed, and nobody would send it again. A queue holds at most `inbound_queue`
commands (R-RP-9): past that, its `Backlog` trades them for a catch-up from the source,
counted in plait_inbound_overflows and logged at most every 10 s. A DEPART (R-RP-8)
waits in each stream's queue and in the application commands' queue (`departures.py`);
application commands after it wait for its listeners.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Protocol

from plait.core.commands import (
    Command,
    CommandSet,
    Depart,
    Error,
    Fenced,
    Name,
    Ping,
    Position,
    Rdata,
    Replicate,
    Server,
    rows_of,
)
from plait.core.inbound import (
    Backlog,
    Departure,
    Queued,
    Resync,
)
from plait.errors import CommandParseError
from plait.replication.departures import Departing, Departures
from plait.replication.following import FollowHost, Following
from plait.replication.link import Link
from plait.replication.listeners import Listeners, call
from plait.replication.retries import GivenUp, handle_surely
from plait.replication.streams import ReplicatedStream

logger = logging.getLogger("plait.replication.handler")  # what operators filter on

# The queue key of application commands (stream names are SQL names: never this).
_APP_QUEUE = "\x00commands"


class SessionHost(FollowHost, Protocol):
    """What a session needs of the replication handler (`ReplicationHandler`)."""

    commands: CommandSet
    listeners: Listeners
    inbound_queue: int
    stopping: bool
    sync_streams: set[str]

    def stream(self, name: str) -> ReplicatedStream | None:
        """The stream named in a command, or None when it is not replicated here."""

    def forget(self, session: HandlerSession) -> None:
        """The session's connection ended and nothing of it waits."""

    def own_task(self, task: asyncio.Task[None]) -> None:
        """Own a task of the session: the handler's `stop` ends it."""

    def drain(self, session: HandlerSession) -> None:
        """The connection ended while commands still wait: they are handled."""

    def drained(self, session: HandlerSession) -> None:
        """What waited was handled."""

    def send_command(self, link: Link, command: Command) -> None:
        """Send one command on one link."""

    def answer_replicate(self, link: Link) -> None:
        """Our position on every stream we write."""

    def delivering(self, stream: str, writer: str) -> asyncio.Lock:
        """Held while rows of `writer` on `stream` are handed over."""

    def is_delivering(self, stream: str, writer: str) -> bool: ...

    async def departed(self, instance: str) -> None:
        """`instance` departed: its departure listeners run."""

    def overflowed(self, stream: ReplicatedStream, link: str) -> None:
        """A stream's inbound queue passed its bound on `link`."""


# What a worker of a connection takes from its queue.
_Work = Command | Queued | Departing


def _label(work: _Work) -> str:
    if isinstance(work, Resync):
        return "catch-up"
    if isinstance(work, Departure | Departing):
        return "DEPART"
    return work.NAME


class HandlerSession:
    """One connection: its inbound state and its per-stream queues."""

    def __init__(
        self, handler: SessionHost, link: Link, reply_errors: bool, authenticated: bool
    ) -> None:
        self._handler = handler
        self.link = link
        self._reply_errors = reply_errors
        self._following = Following(
            handler,
            link.label,
            check_every_claim=not authenticated,
            queue_resync=self._enqueue_stream,
        )
        self._inbound = self._following.inbound
        self._own_name = handler.instance_name
        self._own_bytes = self._own_name.encode()
        # The application's commands; None once the connection ended, after them.
        self._commands: asyncio.Queue[Command | Departing | None] | None = None
        self._backlogs: dict[str, Backlog] = {}  # per stream
        self._departures = Departures()
        self._wakes: dict[str, asyncio.Event] = {}  # set when a backlog got a command
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._busy: set[str] = set()
        self._up = asyncio.Event()
        self._closed = False
        self._watcher = asyncio.create_task(self._watch_up(), name=f"plait-up-{link.label}")
        handler.own_task(self._watcher)

    def queue_length(self, stream: str) -> int:
        backlog = self._backlogs.get(stream)
        return 0 if backlog is None else len(backlog)

    # -- the transport's side ------------------------------------------------------------

    def received(self, line: str | bytes) -> None:
        if self._closed:
            return
        if (
            rows_of(line, self._own_bytes)
            if isinstance(line, bytes)
            else rows_of(line, self._own_name)
        ):
            return  # Redis hands our own RDATA and POSITION back: drop them unparsed
        handler = self._handler
        try:
            command = handler.commands.parse(line)
        except CommandParseError as err:
            handler.metrics.bad_lines.labels(self.link.label).inc()
            # Answered with ERROR (TCP), the transport logs it, at most a line per peer
            # address and interval: one warning per line would let a peer flood the log.
            level = logging.DEBUG if self._reply_errors else logging.WARNING
            logger.log(level, "replication: bad line on %s: %s", self.link.label, err)
            if self._reply_errors:
                handler.send_command(self.link, Error(str(err)))
            return
        handler.metrics.child(handler.metrics.commands_in, command.NAME).inc()
        try:
            self._dispatch(command)
        except Exception:
            logger.exception("replication: handling %s on %s failed", command.NAME, self.link.label)

    async def wait_up(self) -> None:
        await self._up.wait()

    def closed(self) -> None:
        """The connection ended. What it brought and still waits is handled all the same
        (the writer may have departed: nobody would send it again); a new connection
        starts over beside it, and a writer's rows are handed over one command at a
        time, so either one's step is stale to the other. When the handler stops,
        nothing more is handled."""
        if self._closed:
            return
        self._closed = True
        self._watcher.cancel()
        self._handler.forget(self)
        if self._handler.stopping:
            for task in self._workers.values():
                task.cancel()
            return
        for backlog in self._backlogs.values():
            backlog.ended()
        for wake in self._wakes.values():
            wake.set()
        if self._commands is not None:
            self._commands.put_nowait(None)
        if any(not task.done() for task in self._workers.values()):
            self._handler.drain(self)

    # -- dispatch ---------------------------------------------------------------------------

    def _dispatch(self, command: Command) -> None:
        step = self._DISPATCH.get(type(command))
        if step is not None:
            step(self, command)
        elif command.NAME in self._handler.listeners.commands:
            self._enqueue(command)
        else:
            logger.debug("replication: no listener for %s", command.NAME)

    def _on_stream_command(self, command: Rdata | Position | Fenced) -> None:
        """RDATA, POSITION or FENCED: a writer's rows or word about how far it got."""
        handler = self._handler
        stream = handler.stream(command.stream)
        if stream is None:
            return
        if stream.writers is not None and command.instance not in stream.writers:
            # Not a configured writer (removed, or a misconfigured peer): its
            # position is never tracked here, so following it would re-read forever.
            logger.debug("replication: ignoring %s of %s", command.NAME, command.instance)
            return
        backlog = self._backlogs.get(command.stream)
        if (
            isinstance(command, Rdata)
            and command.stream in handler.sync_streams
            and command.stream not in self._busy
            and (backlog is None or backlog.idle())
            and not handler.is_delivering(command.stream, command.instance)
            and (
                command.token is None
                or not self._following.check_every_claim
                or stream.is_known_allocated(stream.sign * command.token)
            )
        ):
            self._following.rdata_now(stream, command)  # nothing queued before it
            return
        self._following.heard(stream, command)
        self._enqueue_stream(stream, command)

    def _on_replicate(self, command: Command) -> None:
        self._handler.answer_replicate(self.link)

    def _on_depart(self, command: Depart) -> None:
        if command.name != self._own_name:  # Redis hands our own back
            self._depart(command.name)

    def _on_error(self, command: Error) -> None:
        logger.warning("replication: %s says: %s", self.link.label, command.text)

    def _on_transport_command(self, command: Command) -> None:
        """NAME, SERVER, PING: the transport's business, handled before the session."""

    def _depart(self, name: str) -> None:
        """Queue the departure of `name` behind its commands on every stream it writes,
        and its listeners behind the application commands."""
        streams = self._handler.streams
        waiting = {
            stream
            for stream in self._backlogs
            if (writers := streams[stream].writers) is None or name in writers
        }
        departing = self._departures.begin(name, waiting)
        for stream in sorted(waiting):
            self._enqueue_stream(streams[stream], Departure(stream, name))
        self._enqueue(departing)

    def _enqueue(self, command: Command | Departing) -> None:
        """An application command or a departure: in order, after the ones before it."""
        queue = self._commands
        if queue is None:
            queue = self._commands = asyncio.Queue()
            self._start_worker(_APP_QUEUE, queue.get, queue.empty)
        queue.put_nowait(command)

    def _enqueue_stream(
        self, stream: ReplicatedStream, command: Rdata | Position | Fenced | Departure | Resync
    ) -> None:
        backlog = self._backlogs.get(stream.name)
        if backlog is None:
            backlog = self._backlogs[stream.name] = Backlog(
                stream.name, self._handler.inbound_queue, stream.sign
            )
            wake = self._wakes[stream.name] = asyncio.Event()

            async def next_command() -> Queued | None:
                while (queued := backlog.pop()) is None:
                    if self._closed:
                        return None
                    wake.clear()
                    await wake.wait()
                return queued

            self._start_worker(stream.name, next_command, lambda: not len(backlog))
        if backlog.push(command):
            self._handler.overflowed(stream, self.link.label)
        self._wakes[stream.name].set()

    def _start_worker(
        self,
        key: str,
        take: Callable[[], Awaitable[_Work | None]],
        empty: Callable[[], bool],
    ) -> None:
        task = asyncio.create_task(
            self._work(key, take, empty), name=f"plait-in-{key}-{self.link.label}"
        )
        self._workers[key] = task
        self._handler.own_task(task)

    async def _work(
        self,
        key: str,
        take: Callable[[], Awaitable[_Work | None]],
        empty: Callable[[], bool],
    ) -> None:
        # Not `while True`: a cancellation by the handler's stop can be swallowed inside
        # `_handle` (psycopg_pool waits for a connection with asyncio.wait_for, which
        # does that on Python 3.11); the worker then ends here, not on a queue nobody
        # feeds (it was logged as a task destroyed while pending).
        try:
            while not self._handler.stopping:
                command = await take()
                if command is None:
                    return  # the connection ended, and everything it brought was handled
                self._busy.add(key)
                try:
                    await self._handle_surely(command)
                except GivenUp:
                    self._give_up(key)
                    return
                finally:
                    if empty():
                        self._busy.discard(key)
        finally:
            if self._closed and all(
                task.done() or task is asyncio.current_task() for task in self._workers.values()
            ):
                self._handler.drained(self)

    async def _handle_surely(self, command: _Work) -> None:
        await handle_surely(
            self._handle,
            command,
            label=_label,
            link=self.link.label,
            on_failure=self.link.close,
            stopping=lambda: self._handler.stopping,
            as_catch_up=self._as_catch_up,
        )

    def _give_up(self, key: str) -> None:
        """A stream's commands are given up: its writers' departures queued among them
        still count (their listeners wait for every stream to get there)."""
        backlog = self._backlogs.get(key)
        while backlog is not None and (command := backlog.pop()) is not None:
            if isinstance(command, Departure):
                self._inbound.departed(command)
                self._departures.handled(command)

    def _as_catch_up(self, command: _Work) -> _Work:
        """What to try again in place of a failed `command`: its writer's rows up to
        what it named, read from the source (a row the codec refused arrives from there
        as the database holds it)."""
        if isinstance(command, Rdata) and command.token is not None:
            upto = self._handler.streams[command.stream].sign * command.token
        elif isinstance(command, Position):
            upto = self._handler.streams[command.stream].sign * command.new
        else:
            return command
        return Resync(command.stream, command.instance, upto)

    async def _handle(self, command: _Work) -> None:
        handler, following = self._handler, self._following
        if isinstance(command, Rdata):
            async with handler.delivering(command.stream, command.instance):
                await following.rdata(command)
        elif isinstance(command, Position):
            async with handler.delivering(command.stream, command.instance):
                await following.position(command)
        elif isinstance(command, Fenced):
            async with handler.delivering(command.stream, command.instance):
                await following.fence(command)
        elif isinstance(command, Resync):
            async with handler.delivering(command.stream, command.instance):
                await following.resync(command)
        elif isinstance(command, Departure):
            self._inbound.departed(command)
            self._departures.handled(command)
        elif isinstance(command, Departing):
            await command.done.wait()
            await handler.departed(command.name)
        else:
            await call(handler.listeners.commands[command.NAME], command)

    async def _watch_up(self) -> None:
        await self._following.watch_up()
        # The transport sets the connection gauge and logs it (it owns the connection).
        self._up.set()

    # What `_dispatch` does with each protocol command (application commands go to their
    # listeners by NAME). Each step takes the type it is keyed by (so no isinstance check
    # on the hot path).
    _DISPATCH: ClassVar[dict[type[Command], Callable[[HandlerSession, Any], None]]] = {
        Rdata: _on_stream_command,
        Position: _on_stream_command,
        Fenced: _on_stream_command,
        Replicate: _on_replicate,
        Depart: _on_depart,
        Error: _on_error,
        Name: _on_transport_command,
        Server: _on_transport_command,
        Ping: _on_transport_command,
    }
