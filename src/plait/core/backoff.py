"""Reconnect delays: capped exponential backoff with jitter, forever. No I/O, no clock.

The transports ask `next_delay()` before each reconnect attempt. The delay grows on
every failure, including one during catch-up: it goes back to the start only on `up()`,
which the shell calls once every stream caught up on the new connection (R-RP-3), so a
connection that fails while catching up can never reconnect in a tight loop.
"""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """Delays `initial * factor**n` seconds, capped at `cap`, each scaled by a random
    factor in [1 - jitter, 1] so that many instances do not reconnect in step."""

    def __init__(
        self,
        *,
        initial: float = 0.1,
        cap: float = 30.0,
        factor: float = 2.0,
        jitter: float = 0.2,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not 0 < initial <= cap:
            raise ValueError("backoff: need 0 < initial <= cap")
        if factor < 1:
            raise ValueError("backoff: factor must be at least 1")
        if not 0 <= jitter < 1:
            raise ValueError("backoff: jitter must be in [0, 1)")
        self._initial = initial
        self._cap = cap
        self._factor = factor
        self._jitter = jitter
        self._rand = rand
        self._base = 0.0  # 0: no failure since the last `up()`

    @property
    def failures_pending(self) -> bool:
        """Whether the next attempt follows a failure (a delay is due)."""
        return self._base > 0

    def next_delay(self) -> float:
        """Seconds to wait before the next attempt; each call counts one more failure."""
        self._base = self._initial if self._base == 0 else min(self._cap, self._base * self._factor)
        return self._base * (1 - self._jitter * self._rand())

    def up(self) -> None:
        """The connection is fully up (every stream caught up): start over."""
        self._base = 0.0
