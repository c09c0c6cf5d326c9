"""How often a repeated warning may be logged. Pure: the caller passes the time.

A peer (or an attacker) can make plait refuse the same kind of line thousands of times
a second; logging each would flood the logs and hide everything else. A `Throttle`
lets one line per key through every `interval` seconds and counts the ones it held
back, so the line that does go out can say how many it stands for. It remembers at
most `max_keys` keys (the oldest are forgotten first), so keys chosen by a peer
cannot grow it without bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class Throttle:
    """At most one pass per key per `interval`; `allow` says how many were held back."""

    def __init__(self, interval: float, *, max_keys: int = 1024) -> None:
        if interval < 0 or max_keys < 1:
            raise ValueError("need interval >= 0 and max_keys >= 1")
        self._interval = interval
        self._max_keys = max_keys
        # key -> (when it last passed, how many were held back since)
        self._keys: OrderedDict[Hashable, tuple[float, int]] = OrderedDict()

    def allow(self, key: Hashable, now: float) -> int | None:
        """None: hold this one back. Else it passes, and the number is how many of
        this key were held back since the last one that passed."""
        entry = self._keys.get(key)
        if entry is not None and now - entry[0] < self._interval:
            self._keys[key] = (entry[0], entry[1] + 1)
            return None
        self._keys[key] = (now, 0)
        self._keys.move_to_end(key)
        while len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)
        return 0 if entry is None else entry[1]
