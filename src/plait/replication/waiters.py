"""Callers waiting until this process has seen a position of another writer (R-RP-6).

The handler calls `release` last, after the rows were delivered and the stream advanced
(R-CA-3), so a released waiter never observes a position whose effects are not in
place yet.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class PositionWaiters:
    """Futures keyed by (stream, writer), released in position order."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str], list[tuple[int, int, asyncio.Future[None]]]] = {}
        self._serial = itertools.count()

    def add(self, stream: str, writer: str, position: int) -> asyncio.Future[None]:
        """A future done once `release` reports `position` (internal domain) seen."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heap = self._waiting.setdefault((stream, writer), [])
        heapq.heappush(heap, (position, next(self._serial), future))
        return future

    def release(self, stream: str, writer: str, seen: int) -> None:
        """Everything waiting for a position at or below `seen` may go on."""
        heap = self._waiting.get((stream, writer))
        if not heap:
            return
        while heap and heap[0][0] <= seen:
            future = heapq.heappop(heap)[2]
            if not future.done():
                future.set_result(None)
        if not heap:
            del self._waiting[(stream, writer)]

    def discard(self, stream: str, writer: str, future: asyncio.Future[None]) -> None:
        """Forget a future whose caller stopped waiting (timeout, cancellation)."""
        heap = self._waiting.get((stream, writer))
        if heap is None:
            return
        heap[:] = [entry for entry in heap if entry[2] is not future]
        heapq.heapify(heap)
        if not heap:
            del self._waiting[(stream, writer)]

    def __len__(self) -> int:
        return sum(len(h) for h in self._waiting.values())
