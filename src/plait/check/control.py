"""The orchestrator's orders to the processes of `plait check`, as each role reads
them: the phase, the faults asked of it, the targets a reader must reach."""

from __future__ import annotations

import asyncio
from typing import Any

from plait.check.journal import Kind
from plait.check.plan import Plan, read_control
from plait.check.seen import Seen

POLL = 0.05  # seconds between two readings of the control file


class Control:
    """The orchestrator's orders, re-read every `POLL` seconds."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self.value: dict[str, Any] = {}
        self.changed = asyncio.Event()

    async def follow(self) -> None:
        while True:
            value = read_control(self._plan.control)
            if value != self.value:
                self.value = value
                self.changed.set()
                self.changed = asyncio.Event()
            await asyncio.sleep(POLL)

    @staticmethod
    def count(value: dict[str, Any], what: str, name: str) -> int:
        orders = value.get(what)
        count = orders.get(name, 0) if isinstance(orders, dict) else 0
        return count if isinstance(count, int) else 0

    def orders(self, what: str, name: str) -> int:
        """How many of `what` the orchestrator has asked of process `name` so far."""
        return self.count(self.value, what, name)

    @property
    def phase(self) -> str:
        return str(self.value.get("phase", "run"))

    def targets(self) -> dict[str, dict[str, dict[str, int]]] | None:
        targets = self.value.get("targets")
        return targets if isinstance(targets, dict) else None

    async def until(self, phase: str) -> None:
        while self.phase != phase:
            await self.changed.wait()


async def read_until_stopped(seen: Seen, control: Control, targets_key: str) -> None:
    """Journal what `seen` holds every 0.1 s; say once when the targets are reached."""
    caught_up = False
    while control.phase != "stop":
        seen.flush()
        targets = control.targets()
        if not caught_up and targets is not None and seen.reached(targets.get(targets_key, {})):
            seen.journal.write(Kind.STATE, "caught-up")
            print("caught-up", flush=True)
            caught_up = True
        await asyncio.sleep(0.1)
    seen.flush()
    seen.journal.write(Kind.STATE, "stopped")
