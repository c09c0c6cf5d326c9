"""The departures a connection has heard (R-RP-8) and what each still waits for.

A DEPART is queued behind its writer's commands on every stream that writer writes (as a
`Departure`), and once in the application commands' queue (as a `Departing`). The
departure listeners run when every one of those streams has handled its `Departure`:
only then were the writer's rows sent before the DEPART all delivered."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from plait.core.inbound import Departure


@dataclass(slots=True)
class Departing:
    """A DEPART in the application commands' queue: its listeners run once every stream
    in `waiting` handled the `Departure` queued behind the writer's commands."""

    name: str
    waiting: set[str]
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Departures:
    """One connection's departures that wait for streams, per writer, oldest first."""

    def __init__(self) -> None:
        self._pending: dict[str, list[Departing]] = {}

    def begin(self, name: str, streams: Iterable[str]) -> Departing:
        """`name` departed; its rows are in the queues of `streams` (none: done now)."""
        departing = Departing(name, set(streams))
        if departing.waiting:
            self._pending.setdefault(name, []).append(departing)
        else:
            departing.done.set()
        return departing

    def handled(self, command: Departure) -> None:
        """A stream handled `command`: the `count` oldest departures of its writer that
        waited for that stream no longer do."""
        pending = self._pending.get(command.instance, [])
        left = command.count
        for departing in pending:
            if left and command.stream in departing.waiting:
                departing.waiting.discard(command.stream)
                left -= 1
                if not departing.waiting:
                    departing.done.set()
        pending[:] = [departing for departing in pending if departing.waiting]
        if not pending:
            self._pending.pop(command.instance, None)
