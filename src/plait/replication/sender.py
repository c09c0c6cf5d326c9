"""Draining one stream's outbox (`plait.streams.outbox`): this instance's own rows as
RDATA with a trailing POSITION (R-RP-4), and the dead writers it fenced, handed to the
handler."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from plait.core.backoff import Backoff
from plait.core.commands import to_line, with_sign
from plait.core.outbound import Outbound
from plait.replication.streams import ReplicatedStream
from plait.streams.memory import ReadPage

logger = logging.getLogger(__name__)


class SenderHandler(Protocol):
    """What a sender needs of the handler."""

    @property
    def instance_name(self) -> str: ...

    def send_lines(self, lines: list[str]) -> None:
        """Send these lines to every peer."""

    def fenced(self, stream: ReplicatedStream, writer: str, signed: int) -> None:
        """This instance fenced dead `writer` of `stream` up to `signed`."""


class Sender:
    """Takes what one stream's writer posts to its outbox and sends it.

    The outbox schedules `_posted` on the event loop after a write's IDs complete
    (never inside the write). Rows the outbox holds (writes that returned whole rows;
    in-memory streams) go out from there at once, with no task switch; anything else
    wakes the sender's task, which reads the rows back, and while it does, later rows
    wait for it, so the order holds. A move with no write of ours (the idle rule,
    R-ID-5) is posted nowhere; the announcer's tick (`announce`) finds it. A stream
    this instance does not write has only fences to hand over (`outbound` is None)."""

    def __init__(self, handler: SenderHandler, stream: ReplicatedStream) -> None:
        self._handler = handler
        self.stream = stream
        position = stream.own_position()
        self.outbound = (
            None if position is None else Outbound(stream.name, handler.instance_name, position)
        )
        self._wake = asyncio.Event()
        self._reading = False  # the task is reading rows back: send nothing meanwhile
        self._closed = False
        # Before the first write: nothing is missed.
        self.outbox = stream.open_outbox(self._posted)

    def __str__(self) -> str:
        return self.stream.name

    def announce(self) -> None:
        """The announce interval passed: a move of our position nothing posted (the
        idle rule, a failed fetch's end) goes out now. The rule is that a writer whose
        position moved announces it within the interval (R-RP-4)."""
        outbound = self.outbound
        if outbound is not None:
            position = self.stream.own_position()
            if position is not None and position > outbound.sent_upto:
                self._posted()

    def _posted(self) -> None:
        if self._closed:
            return
        for writer, signed in self.outbox.take_fences():
            try:
                self._handler.fenced(self.stream, writer, signed)
            except Exception:  # the fencer tries the writer again later
                logger.exception("replication: handing on the fence of %s on %s", writer, self)
        if self.outbound is None:
            return
        if self._reading:
            self._wake.set()
            return
        try:
            if self._send_known(self.outbound):
                return
        except Exception as err:  # the task retries
            logger.warning("replication: sending rows of %s failed: %s", self, err)
        self._wake.set()

    async def run(self) -> None:
        backoff = Backoff(initial=0.2, cap=5.0)
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
                backoff.up()
            except Exception as err:
                # Peers catch up by themselves on our next POSITION; retry soon.
                logger.warning("replication: sending rows of %s failed: %s", self, err)
                await asyncio.sleep(backoff.next_delay())
                self._wake.set()

    def _send_known(self, outbound: Outbound) -> bool:
        """Send what the outbox holds; False when rows must be read back first."""
        stream = self.stream
        while True:
            target = stream.own_position()
            if target is None or target <= outbound.sent_upto:
                return True
            page = stream.read_known(outbound.sent_upto, target)
            if page is None:
                return False
            self._send(outbound, page)

    async def flush(self) -> None:
        """Send every own row up to our current position, then the position itself."""
        outbound = self.outbound
        if outbound is None:
            return
        self._reading = True
        try:
            while not self._send_known(outbound):
                target = self.stream.own_position()
                assert target is not None
                self._send(outbound, await self.stream.read_own(outbound.sent_upto, target))
        finally:
            self._reading = False

    async def close(self) -> None:
        """Send what is left (the task is stopped already); send nothing after."""
        self._closed = True
        await self.flush()

    def _send(self, outbound: Outbound, page: ReadPage) -> None:
        # Synchronous from building to sending: a REPLICATE answered meanwhile must not
        # announce a position whose rows were not sent yet.
        sign = self.stream.sign
        try:
            lines = [to_line(with_sign(c, sign)) for c in outbound.page(page.rows, page.upto)]
        except ValueError as err:
            # A row that cannot travel (too long, not JSON): claim nothing about the
            # range, so every reader reads it from the source instead.
            logger.warning(
                "replication: rows of %s up to %d cannot be sent (%s); readers will read them back",
                self,
                sign * page.upto,
                err,
            )
            lines = [to_line(with_sign(outbound.skip(page.upto), sign))]
        self._handler.send_lines(lines)
