"""What the transport tests share: a Backoff that records, and waiting for a condition."""

from __future__ import annotations

from collections.abc import Callable

import pace
from plait.core.backoff import Backoff


class RecordingBackoff(Backoff):
    """No jitter, and a record of every delay asked for and every `up()` (also into
    `events`, when given, to check its order against other events)."""

    def __init__(
        self, events: list[str] | None = None, *, initial: float = 0.05, cap: float = 0.4
    ) -> None:
        super().__init__(initial=initial, cap=cap, factor=2.0, jitter=0.0)
        self.events = events
        self.delays: list[float] = []
        self.ups = 0

    def next_delay(self) -> float:
        delay = super().next_delay()
        self.delays.append(delay)
        return delay

    def up(self) -> None:
        self.ups += 1
        if self.events is not None:
            self.events.append("backoff up")
        super().up()


async def eventually(condition: Callable[[], bool], what: str, within: float = 3.0) -> None:
    """Returns once `condition()` holds; fails the test after `within` seconds at this
    machine's pace (`pace.until`, asking every 5 ms)."""
    await pace.until(condition, within, what, every=0.005)
