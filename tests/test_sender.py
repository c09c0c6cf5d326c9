"""The replication sender (`plait.replication.sender`) against a stream and a handler of
the test's own (no database, no transport): what it sends after posts, after a tick of
the announcer, and after it stopped."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from plait.core.commands import CommandSet, Fenced, Position, Rdata
from plait.replication.sender import Sender
from plait.replication.streams import ReplicatedStream
from plait.streams.memory import ReadPage
from plait.streams.outbox import Outbox


class Stream:
    """A writer's stream whose rows are (token, {"n": token}) for every token written."""

    name = "s"
    sign = 1

    def __init__(self) -> None:
        self.position = 10
        self.written: list[int] = []
        self.outbox = Outbox()

    def own_position(self) -> int | None:
        return self.position

    def open_outbox(self, reader: Any = None) -> Outbox:
        self.outbox.open(reader)
        return self.outbox

    def read_known(self, from_exclusive: int, to_inclusive: int) -> ReadPage:
        rows = [(t, {"n": t}) for t in self.written if from_exclusive < t <= to_inclusive]
        return ReadPage(rows, to_inclusive, False)

    async def read_own(self, from_exclusive: int, to_inclusive: int) -> ReadPage:
        return self.read_known(from_exclusive, to_inclusive)

    def write(self, token: int) -> None:
        self.written.append(token)
        self.position = token
        self.outbox.moved()


COMMANDS = CommandSet()


class Handler:
    instance_name = "w1"

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.fences: list[tuple[str, int]] = []

    def send_lines(self, lines: list[str]) -> None:
        self.sent.extend(COMMANDS.parse(line) for line in lines)

    def fenced(self, stream: ReplicatedStream, writer: str, signed: int) -> None:
        self.fences.append((writer, signed))


def make() -> tuple[Stream, Handler, Sender]:
    stream, handler = Stream(), Handler()
    return stream, handler, Sender(handler, cast(ReplicatedStream, stream))


async def test_a_write_is_sent_after_it_returns_with_its_position() -> None:
    stream, handler, _ = make()
    stream.write(11)
    stream.write(12)
    assert handler.sent == []  # nothing inside the writes
    await asyncio.sleep(0)
    rows = [c for c in handler.sent if isinstance(c, Rdata)]
    assert [(c.token, c.row) for c in rows] == [(11, {"n": 11}), (12, {"n": 12})]
    assert not any(isinstance(c, Position) for c in handler.sent)  # the last row says 12


async def test_a_move_nothing_posted_is_announced_at_the_next_tick() -> None:
    """R-RP-4: a writer whose position moved announces it within the interval, also
    when the move posted nothing (say, a failed fetch's end let the idle position
    move); and a tick with nothing moved sends nothing."""
    stream, handler, sender = make()
    stream.position = 15  # moved by the idle rule, unposted
    sender.announce()
    await asyncio.sleep(0)
    assert [(c.prev, c.new) for c in handler.sent if isinstance(c, Position)] == [(10, 15)]
    handler.sent.clear()
    sender.announce()
    await asyncio.sleep(0)
    assert handler.sent == []


async def test_an_idle_move_waits_for_the_tick_and_a_fence_does_not() -> None:
    stream, handler, sender = make()
    stream.position = 13  # the idle rule moved it: posted nowhere
    await asyncio.sleep(0)
    assert handler.sent == []  # not once per position heard
    stream.outbox.fenced("w2", 40)
    await asyncio.sleep(0)
    assert handler.fences == [("w2", 40)]
    # The fence's pass sent the idle move with it (it sends up to the position).
    assert [(c.prev, c.new) for c in handler.sent if isinstance(c, Position)] == [(10, 13)]
    assert not any(isinstance(c, Fenced) for c in handler.sent)  # the handler says FENCED
    handler.sent.clear()
    stream.position = 14
    sender.announce()
    assert [(c.prev, c.new) for c in handler.sent if isinstance(c, Position)] == [(13, 14)]


async def test_nothing_is_sent_after_close() -> None:
    stream, handler, sender = make()
    stream.write(11)
    await sender.close()  # sends what is left
    sent = len(handler.sent)
    assert sent >= 1
    stream.write(12)
    sender.announce()
    await asyncio.sleep(0)
    assert len(handler.sent) == sent
