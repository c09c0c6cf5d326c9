"""Sending this instance's own rows of one stream, as they complete (R-RP-4): RDATA for the rows
and a trailing POSITION, from the write's completion itself when the rows are known,
else from the sender's task, which reads them back."""

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


class SendsLines(Protocol):
    """What a sender needs of the handler: its name, and a way to send lines."""

    @property
    def instance_name(self) -> str: ...

    def send_lines(self, lines: list[str]) -> None: ...


class Sender:
    """Sends this instance's rows of one stream as they complete.

    Rows the stream knows without a query (in-memory streams; writes that returned whole
    rows) go out synchronously, from the write's completion itself: no task switch
    between a commit and its RDATA. Anything else wakes the sender's task, which reads
    the rows back; while it does, later rows wait for it, so the order holds."""

    def __init__(self, handler: SendsLines, stream: ReplicatedStream) -> None:
        self._handler = handler
        self.stream = stream
        position = stream.own_position()
        assert position is not None
        self.outbound = Outbound(stream.name, handler.instance_name, position)
        self._wake = asyncio.Event()
        self._reading = False  # the task is reading rows back: send nothing meanwhile
        stream.track_own_writes()
        stream.add_moved_listener(self._moved)

    def __str__(self) -> str:
        return self.stream.name

    def wake_if_moved(self) -> None:
        position = self.stream.own_position()
        if position is not None and position > self.outbound.sent_upto:
            self._wake.set()

    def _moved(self) -> None:
        if self._reading:
            self._wake.set()
            return
        try:
            if self._send_known():
                return
        except Exception as err:  # never into the writer's own code path
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

    def _send_known(self) -> bool:
        """Send what needs no query; False when rows must be read back first."""
        stream, outbound = self.stream, self.outbound
        while True:
            target = stream.own_position()
            if target is None or target <= outbound.sent_upto:
                return True
            page = stream.read_known(outbound.sent_upto, target)
            if page is None:
                return False
            self._send(page)

    async def flush(self) -> None:
        """Send every row up to our current position, then the position itself."""
        stream, outbound = self.stream, self.outbound
        self._reading = True
        try:
            while not self._send_known():
                target = stream.own_position()
                assert target is not None
                page = await stream.read_own(outbound.sent_upto, target)
                self._send(page)
        finally:
            self._reading = False

    def _send(self, page: ReadPage) -> None:
        # Synchronous from building to sending: a REPLICATE answered meanwhile must not
        # announce a position whose rows were not sent yet.
        sign, outbound = self.stream.sign, self.outbound
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
