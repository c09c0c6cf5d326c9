"""Concurrent allocations on one writer share sequence round trips (R-ID-13).

Callers queue requests; one fetch at a time asks the sequence for the sum of everything
queued and hands each caller its slice. No lock is held across the round trip: the
tracker is told a fetch is in flight before the request leaves, so the writer's position
cannot pass IDs that are on their way back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from plait.core.pending_ages import PendingAges
from plait.core.positions import FetchTicket, PositionTracker, SequenceWentBackwardsError
from plait.errors import SequenceBehindError
from plait.tasks import let_finish

logger = logging.getLogger(__name__)

Fetch = Callable[[int], Awaitable[list[int]]]


class IdAllocator:
    """Batches `allocate(n)` calls into shared `fetch(total)` round trips."""

    def __init__(
        self, fetches: Fetches, fetch: Fetch, give_back: Callable[[list[int]], None]
    ) -> None:
        self._fetches = fetches
        self._fetch = fetch
        # IDs whose caller went away (cancelled) complete at once, with no rows.
        self._give_back = give_back
        self._queue: list[tuple[int, asyncio.Future[list[int]]]] = []
        self._pump: asyncio.Task[None] | None = None
        self._busy = False  # a caller is fetching directly
        self.round_trips = 0

    async def allocate(self, n: int) -> list[int]:
        if self._pump is None and not self._busy:
            return await self._allocate_directly(n)
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._queue.append((n, future))
        if self._pump is None and not self._busy:  # else the direct fetcher starts it
            self._pump = asyncio.create_task(self._run(), name="plait-id-allocator")
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._give_back(future.result())
            raise

    async def _allocate_directly(self, n: int) -> list[int]:
        """Nothing in flight: fetch in the caller's task (no task or future to set up).

        Callers arriving meanwhile queue up and are served together once this returns.
        """
        self._busy = True
        try:
            self.round_trips += 1
            return await take_ids(self._fetches, lambda: self._fetch(n))
        finally:
            self._busy = False
            if self._queue and self._pump is None:
                self._pump = asyncio.create_task(self._run(), name="plait-id-allocator")

    async def _run(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                await self._serve(batch)
        finally:
            self._pump = None

    async def _serve(self, batch: list[tuple[int, asyncio.Future[list[int]]]]) -> None:
        self.round_trips += 1
        total = sum(n for n, _ in batch)
        try:
            ids = await take_ids(self._fetches, lambda: self._fetch(total))
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as err:  # also the refusal when the sequence went backwards
            for _, future in batch:
                if not future.done():
                    future.set_exception(err)
            return
        start = 0
        for n, future in batch:
            part = ids[start : start + n]
            start += n
            if future.done():
                self._give_back(part)
            else:
                future.set_result(part)

    async def close(self) -> None:
        """Let a fetch in progress finish (its callers still get their IDs)."""
        if self._pump is not None:
            await let_finish(self._pump)


class Fetches:
    """Every fetch of IDs goes through here: the tracker's ticket, which keeps this
    writer's position below IDs still on their way, and when the fetch began, for the
    age of the oldest unfinished ID (`PendingAges`)."""

    __slots__ = ("_ages", "_handed_out", "tracker")

    def __init__(
        self, tracker: PositionTracker, handed_out: Callable[[int], None] = lambda _: None
    ) -> None:
        self.tracker = tracker
        self._ages = PendingAges()
        self._handed_out = handed_out  # told the largest ID of each fetch

    def begin(self) -> FetchTicket:
        ticket = self.tracker.begin_fetch()
        self._ages.began(ticket.serial, time.monotonic())
        return ticket

    def end(self, ticket: FetchTicket, ids: list[int], *, completed: bool = False) -> None:
        """The fetch returned `ids` (none if it failed); with `completed` they are
        finished already. Raises what `PositionTracker.end_fetch` raises."""
        tracker = self.tracker
        pending: list[int] = []
        try:
            tracker.end_fetch(ticket, ids, completed=completed)
            pending = [] if completed else ids
        finally:
            self._ages.ended(ticket.serial, pending, tracker.lowest_unfinished)
        if ids:
            self._handed_out(max(ids))

    def oldest_began(self) -> float | None:
        """When the work holding this writer's position began (`time.monotonic`)."""
        return self._ages.oldest(self.tracker.lowest_unfinished)


async def take_ids(
    fetches: Fetches,
    fetch: Callable[[], Awaitable[list[int]]],
    *,
    completed: bool = False,
    unsettled: Callable[[FetchTicket, BaseException], bool] | None = None,
) -> list[int]:
    """Run `fetch`, which takes IDs from the sequence, under a fetch ticket, so the
    position cannot pass those IDs before the tracker knows them. With `completed`, the
    IDs are finished when `fetch` returns (a statement that committed). When `fetch`
    fails, `unsettled(ticket, error)` may take the ticket over (True) and end it once
    the failed statement's outcome is known."""
    ticket = fetches.begin()
    try:
        ids = await fetch()
    except BaseException as error:
        if unsettled is not None and unsettled(ticket, error):
            raise
        # Whatever it took was never handed out, or is already committed or rolled
        # back: nothing of it is left pending.
        fetches.end(ticket, [])
        raise
    try:
        fetches.end(ticket, ids, completed=completed)
    except SequenceWentBackwardsError as err:
        raise _refusal(err) from None
    return ids


def _refusal(err: SequenceWentBackwardsError) -> SequenceBehindError:
    logger.error("%s", err)
    return SequenceBehindError(
        f"{err}. Allocation refused to avoid handing out an ID twice: stop all writers "
        "and restart them so the sequence is checked and repaired"
    )
