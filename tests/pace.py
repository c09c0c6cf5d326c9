"""How slow this machine runs the tests right now, for bounds that are about speed.

A bound about speed (how long a stall may last, how soon something starts) holds on a
quiet machine; on a busy one (other work running, a laptop on battery) the same code
takes longer without being wrong. `slowness()` says how much longer: the environment's
PLAIT_TEST_SLOWNESS when set, else the load average per core the tests may use (1 on a
quiet machine, 4.5 at load 9 on 2 cores), read anew at each call so that it follows the
load through a long run. `scaled(seconds)` is a bound for this machine now.

The same guarantees on their strict, quiet-machine bounds live in tests marked `timing`
(`pytest -m timing`, which CI runs on its quiet machine); the default run leaves them out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

MAX_SLOWNESS = 10.0  # past this the machine is not busy but stuck: let the test say so


def slowness() -> float:
    given = os.environ.get("PLAIT_TEST_SLOWNESS")
    if given:
        return min(MAX_SLOWNESS, max(1.0, float(given)))
    # The load average counts the whole machine's run queue, so it is shared out over
    # the whole machine's cores (a container pinned to fewer would see it inflated).
    return min(MAX_SLOWNESS, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def scaled(seconds: float) -> float:
    """`seconds`, a bound measured on a quiet machine, for this machine's pace now."""
    return seconds * slowness()


@contextlib.asynccontextmanager
async def within(seconds: float, what: str) -> AsyncIterator[None]:
    """`asyncio.timeout` for `seconds` at this machine's pace (`scaled`), whose
    TimeoutError says what was waited for and for how long."""
    limit = scaled(seconds)
    try:
        async with asyncio.timeout(limit):
            yield
    except TimeoutError:
        raise TimeoutError(f"waited {limit:.1f} s for {what}") from None
