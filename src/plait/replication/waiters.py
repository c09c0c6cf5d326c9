"""Callers waiting until this process has seen a position of another writer (R-RP-6).

The handler calls `release` last, after the rows were delivered and the stream advanced
(R-CA-3), so a released waiter never observes a position whose effects are not in
place yet.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time

from plait.core.throttle import Throttle
from plait.replication.metrics import ReplicationMetrics
from plait.replication.streams import ReplicatedStream

logger = logging.getLogger("plait.instance")  # what operators filter on


class PositionWaiters:
    """Futures keyed by (stream, writer), released in position order."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str], list[tuple[int, int, asyncio.Future[None]]]] = {}
        self._serial = itertools.count()
        self._refused = Throttle(10.0)  # one warning per stream this often

    async def wait(
        self,
        replicated: ReplicatedStream,
        instance: str,
        position: int,
        timeout: float,  # noqa: ASYNC109 (R-RP-6)
        *,
        metrics: ReplicationMetrics,
        waiter: str,
    ) -> bool:
        """Whether `instance` reaches `position` (signed) on `replicated` within
        `timeout` seconds: True at once for a position seen already; False, logged, on
        timeout, and at once for a position no write can ever reach (above the
        sequence head: waiting would only stall the caller, R-ID-14). `waiter` is this
        instance's name, for the log."""
        stream = replicated.name
        internal = replicated.sign * position
        if replicated.seen(instance) >= internal:
            return True
        if not replicated.is_known_allocated(internal) and not await replicated.is_allocated(
            internal
        ):
            metrics.refused_positions.labels(stream).inc()
            if (held := self._refused.allow(stream, time.monotonic())) is not None:
                logger.warning(
                    "instance %s: not waiting for %s to reach %d on %s: no ID that high "
                    "was handed out yet (a forged or corrupted position)%s",
                    waiter,
                    instance,
                    position,
                    stream,
                    f"; {held} more refused since the last warning" if held else "",
                )
            return False
        if replicated.seen(instance) >= internal:
            return True  # it arrived while the head was read: no release would come
        future = self.add(stream, instance, internal)
        try:
            async with asyncio.timeout(timeout):
                await future
            return True
        except TimeoutError:
            self.discard(stream, instance, future)
            metrics.wait_timeouts.labels(stream).inc()
            logger.warning(
                "instance %s: timed out after %.1f s waiting for %s to reach %d on %s (seen %d)",
                waiter,
                timeout,
                instance,
                position,
                stream,
                replicated.sign * replicated.seen(instance),
            )
            return False

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
