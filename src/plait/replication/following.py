"""What one connection has heard of each writer, and what it does about it once a
command's turn comes (R-RP-2, R-RP-3): a row accepted by the pure inbound state and
delivered, a POSITION followed (with a catch-up in pages when the writer is out of
reach), a FENCED proven against the database first, a catch-up for commands a full
backlog dropped; every claim checked against the sequence on an unauthenticated link
(R-ID-14). And when the connection counts as up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from plait.core.commands import Fenced, Position, Rdata, with_sign
from plait.core.inbound import Inbound, Plan, Resync
from plait.core.throttle import Throttle
from plait.replication.metrics import ReplicationMetrics
from plait.replication.streams import ReplicatedStream

logger = logging.getLogger("plait.replication.handler")  # what operators filter on


class FollowHost(Protocol):
    """What following writers needs of the replication handler."""

    streams: dict[str, ReplicatedStream]
    metrics: ReplicationMetrics
    up_grace: float
    warnings: Throttle

    @property
    def instance_name(self) -> str: ...

    def expected_writers(self) -> set[tuple[str, str]]:
        """(stream, writer) of every configured writer but this instance."""

    async def deliver(
        self, stream: ReplicatedStream, writer: str, token: int, rows: list[Any]
    ) -> None:
        """Hand rows over, in R-CA-3's order."""

    def deliver_now(
        self, stream: ReplicatedStream, writer: str, token: int, rows: list[Any]
    ) -> None:
        """`deliver`, for a stream whose listeners are all plain functions."""

    async def catch_up(
        self, stream: ReplicatedStream, writer: str, from_exclusive: int, to_inclusive: int
    ) -> None:
        """Read and deliver `writer`'s rows in (from, to]."""

    def refuse(
        self, stream: ReplicatedStream, command: Rdata | Position | Fenced, link: str
    ) -> None:
        """A claim that failed its check: dropped, counted and logged."""


class Following:
    """One connection's view of the writers it carries (`Inbound`), and the steps that
    handle their commands."""

    def __init__(
        self,
        host: FollowHost,
        label: str,
        *,
        check_every_claim: bool,
        queue_resync: Callable[[ReplicatedStream, Resync], None],
    ) -> None:
        self._host = host
        self._label = label
        # Unauthenticated lines may come from anyone: every claim above the sequence
        # head known here is checked against the sequence before it counts (R-ID-14).
        # Authenticated ones carry a writer's word about its own IDs, which it took
        # from the sequence (the transports refuse RDATA and POSITION in another's
        # name). A FENCED, on another's behalf, is always checked against the database.
        self.check_every_claim = check_every_claim
        self.inbound = Inbound(host.instance_name)
        self._queue_resync = queue_resync  # a row to read from the source instead
        self._announced: set[tuple[str, str]] = set()  # writers that spoke here
        self._changed = asyncio.Event()  # a writer caught up

    def heard(self, stream: ReplicatedStream, command: Rdata | Position | Fenced) -> None:
        """A writer's word about how far it got, queued behind others: heard now, it
        moves this instance's idle position at once (`ReplicatedStream.heard`)."""
        if isinstance(command, Position):  # checked as `_position` checks it
            said = command.new
            claim = max(stream.sign * command.prev, stream.sign * command.new)
        elif isinstance(command, Rdata) and command.token is not None:
            said = command.token
            claim = stream.sign * said
        else:
            return  # a batch row says nothing; a FENCED counts once the database shows it
        if not self.check_every_claim or stream.is_known_allocated(claim):
            stream.heard(command.instance, stream.sign * said)

    def accept(self, stream: ReplicatedStream, command: Rdata) -> tuple[int, list[Any]] | None:
        """What the pure inbound state makes of a row: (token, rows) to deliver, if any."""
        internal = with_sign(command, stream.sign)
        assert isinstance(internal, Rdata)
        deliver = self.inbound.rdata(internal, stream.seen(command.instance))
        if deliver is None:
            return None
        rows = [stream.decode(row) for row in deliver.rows]
        metrics = self._host.metrics
        metrics.child(metrics.rdata_rows, stream.name).inc(len(rows))
        return deliver.token, rows

    async def rdata(self, command: Rdata) -> None:
        stream = self._host.streams[command.stream]
        if (
            self.check_every_claim
            and command.token is not None
            and not await stream.is_allocated(stream.sign * command.token)
        ):
            self._host.refuse(stream, command, self._label)
            return
        accepted = self.accept(stream, command)
        if accepted is not None:
            await self._host.deliver(stream, command.instance, *accepted)

    def rdata_now(self, stream: ReplicatedStream, command: Rdata) -> None:
        try:
            accepted = self.accept(stream, command)
        except Exception as err:  # a row the codec refuses: read its rows from the source
            # Only a numbered row is decoded, with the batch rows before it, which the
            # inbound state has handed over: the catch-up reads them all.
            assert command.token is not None
            key = ("decode", self._label, stream.name, command.instance)
            held = self._host.warnings.allow(key, time.monotonic())
            if held is not None:
                logger.warning(
                    "replication: a row of %s on %s arrived that the row type of %s refuses "
                    "(%s: %s; %d more like it not logged); reading it from the database",
                    command.instance,
                    self._label,
                    stream.name,
                    type(err).__name__,
                    err,
                    held,
                )
            upto = stream.sign * command.token
            self._queue_resync(stream, Resync(stream.name, command.instance, upto))
            return
        if accepted is not None:
            self._host.deliver_now(stream, command.instance, *accepted)

    async def position(self, command: Position) -> None:
        handler = self._host
        stream = handler.streams[command.stream]
        internal = with_sign(command, stream.sign)
        assert isinstance(internal, Position)
        if self.check_every_claim and not await stream.is_allocated(
            max(internal.prev, internal.new)
        ):
            handler.refuse(stream, command, self._label)
            return
        plan = self.inbound.position(internal, stream.seen(command.instance))
        if plan is not None:
            await self.follow(stream, plan)

    async def fence(self, command: Fenced) -> None:
        """Another instance fenced a writer: follow it as that writer's POSITION from
        wherever this process is, once the database shows the fence (R-ID-14)."""
        handler = self._host
        stream = handler.streams[command.stream]
        internal = with_sign(command, stream.sign)
        assert isinstance(internal, Fenced)
        plan = self.inbound.fenced(internal, stream.seen(command.instance))
        if plan is None:
            return  # nothing to move (or this run's own: its renewal reads the database)
        if not await stream.is_proven_fence(command.instance, internal.position):
            handler.refuse(stream, command, self._label)
            return
        await self.follow(stream, plan)

    async def resync(self, command: Resync) -> None:
        """Commands of a writer were dropped from a full backlog: read what they carried."""
        stream = self._host.streams[command.stream]
        plan = self.inbound.resync(command, stream.seen(command.instance))
        if plan is None:
            return
        # The dropped commands were the writer's own (FENCED never folds into a Resync):
        # checked as they would have been. Refused, the writer counts again at its next
        # POSITION.
        if (
            self.check_every_claim
            and plan.advance_to is not None
            and not await stream.is_allocated(plan.advance_to)
        ):
            signed = stream.sign * plan.advance_to
            claim = Position(command.stream, command.instance, signed, signed)
            self._host.refuse(stream, claim, self._label)
            return
        await self.follow(stream, plan)

    async def follow(self, stream: ReplicatedStream, plan: Plan) -> None:
        """Do what a `Plan` asks, then (unless it came from a fence) count the writer's
        RDATA on this connection."""
        handler = self._host
        if plan.counts_rows:
            self._announced.add((plan.stream, plan.instance))
        if plan.catch_up_from is not None and plan.advance_to is not None:
            await handler.catch_up(stream, plan.instance, plan.catch_up_from, plan.advance_to)
        elif plan.advance_to is not None:
            await handler.deliver(stream, plan.instance, plan.advance_to, [])
        if plan.counts_rows:
            self.inbound.caught_up(plan.stream, plan.instance)
            self._changed.set()

    async def watch_up(self) -> None:
        """Return once the connection counts as up: every expected writer caught up on
        it, or, past the host's `up_grace`, every writer that spoke on it."""
        handler = self._host
        loop = asyncio.get_running_loop()
        deadline = loop.time() + handler.up_grace
        expected = handler.expected_writers()
        while True:
            if self.inbound.all_connected(expected) or (
                loop.time() >= deadline and self.inbound.all_connected(self._announced)
            ):
                break
            self._changed.clear()
            timeout = max(0.0, deadline - loop.time()) if loop.time() < deadline else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
