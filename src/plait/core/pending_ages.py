"""How long the work holding a writer's position has been unfinished (R-OP-2). Pure: the
caller passes the times and the lowest unfinished ID from its `PositionTracker`.

A writer's position waits on two kinds of work: fetches of IDs still in flight (a
statement that takes its own IDs, a COMMIT carrying an insert) and IDs handed out and not
yet finished. A fetch's IDs are born when it began, so each batch of IDs keeps its
fetch's start time, keyed by its lowest ID. The answer is the earliest of the oldest
fetch in flight and the batch holding the lowest unfinished ID: that one ID, not the
others, is what keeps readers from moving on.

Nothing here runs per ID: a write adds one batch and drops those wholly below the lowest
unfinished ID. So the batches kept are those from the one holding the lowest unfinished
ID on: one or two, unless an ID is held for long while others keep writing (then about
as much as the tracker itself keeps for the IDs finished above it).
"""

from __future__ import annotations

from bisect import insort
from collections import deque


class PendingAges:
    __slots__ = ("_batches", "_fetches")

    def __init__(self) -> None:
        # fetch serial -> when it began; dicts keep insertion order, so the first is oldest
        self._fetches: dict[int, float] = {}
        # (lowest ID of a batch, when its fetch began), ascending by ID
        self._batches: deque[tuple[int, float]] = deque()

    def began(self, serial: int, now: float) -> None:
        """A fetch of IDs (its tracker ticket's serial) started at `now`."""
        self._fetches[serial] = now

    def ended(self, serial: int, unfinished: list[int], lowest: int | None) -> None:
        """The fetch returned; `unfinished` are its IDs still to finish (none when it
        failed or its IDs completed with it) and `lowest` the tracker's lowest
        unfinished ID now."""
        started = self._fetches.pop(serial, None)
        if started is not None and unfinished:
            batch = (min(unfinished), started)
            batches = self._batches
            if not batches or batch[0] > batches[-1][0]:
                batches.append(batch)
            else:  # concurrent fetches can return out of order: rare, keep it sorted
                insort(batches, batch)
        self._drop_below(lowest)

    def oldest(self, lowest: int | None) -> float | None:
        """When the oldest pending work began, given the lowest unfinished ID; None when
        nothing is pending."""
        self._drop_below(lowest)
        times = [next(iter(self._fetches.values()))] if self._fetches else []
        if lowest is not None and self._batches and self._batches[0][0] <= lowest:
            times.append(self._batches[0][1])
        return min(times, default=None)

    def _drop_below(self, lowest: int | None) -> None:
        """Forget the batches below the one holding `lowest`: all their IDs finished.

        That holds when batches are disjoint runs of IDs, as they are unless two fetches
        overlap in time and the sequence interleaves their IDs; then a batch can go a
        little early and the answer is off by at most that overlap."""
        batches = self._batches
        if lowest is None:
            batches.clear()
            return
        while len(batches) > 1 and batches[1][0] <= lowest:
            batches.popleft()
