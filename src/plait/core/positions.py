"""What one process knows about the positions of one stream's writers. Pure: no I/O.

Everything that moves a position lives in this file; it does not know about SQL,
sockets or time. Callers feed it events (a fetch of IDs began or ended, local IDs
completed, another writer advanced, rows were seen) and read positions back.

Vocabulary. IDs are in the *internal* domain, where they always grow; a backwards
stream negates them before they get here. A writer's *position* p is a promise that
every ID of that writer at or below p has completed (committed or rolled back), and
that p itself is a completed ID. *Persisted-up-to* is the largest ID at or below which
every ID of every writer has completed.

Invariants (tests/test_positions.py checks them with Hypothesis):
- The local writer's position never passes its smallest unfinished ID, nor any ID an
  in-flight fetch may still return.
- Nothing moves backwards: writer positions, the local reported position and
  persisted-up-to are monotone.
- Persisted-up-to is sound: every ID at or below it has completed, provided every value
  fed to `advance` or `observe_completed` is a completed ID. The positions this class
  reports always are, so trackers that feed each other stay sound.
- An idle local writer (nothing unfinished, nothing in flight) reports the largest
  completed ID it has seen anywhere, so it never holds back the others.

Why the reported position of a starting writer is not simply the sequence head: the
head may be an ID another writer still has in flight. A reader told "W is at H" would
treat H as completed and could step over it, then never see that row. So a starting
writer reports the largest ID it *knows* completed; that is the head whenever the head
is known to be complete.

Positions through a crash or a restart (R-ID-14: never backwards). Position rows are
stored with asynchronous commit (a WAL flush per write would cost more than the write),
so a crash of PostgreSQL loses the ones of its last moments. A writer therefore starts
at the largest of: its stored row, its own committed rows above it, and every completed
ID the start-up survey sees (the idle rule). Its own rows count as completed IDs, and
every own ID below them as finished, because its previous run is over: registration
waits until no server process carries that run's name (everything it did is committed
or rolled back), and a previous run still alive that connects again later finds itself
superseded and may write nothing more (`storage/incarnation.py`). Committed rows are
durable: their commits wait for the WAL.
A position no row shows (the ID of a rolled-back write, or one the idle rule took from
another writer) may survive nowhere: its asynchronous store is lost when PostgreSQL
crashes, and the writer process may die with it. So a starting writer that finds its
position below the sequence head takes one ID from the sequence and starts at it,
unused (`WriterRows.register`, durable): every position its previous runs reported was
an ID the sequence had handed out, so it is at or below the head, and the head itself
may not do, being perhaps another writer's ID still in flight. A writer that lives
through a crash stores its position again, durably, once it found a connection dead,
and stores durably when it stops (`streams/position_writer.py`), so that what others
read from `stream_positions` does not go back either.
The sequence itself goes back in a crash when the log record that took it past some IDs
had not reached the disk: PostgreSQL logs a sequence 32 values ahead, and only a flush
of the WAL (a commit that wrote something, the WAL writer) makes that record last; a
rollback flushes nothing. So the IDs of a transaction that rolled back, or of a
`get_next` block (which may have written no row), are finished here only once the WAL
is on disk up to them (`streams/completion.py`: `Finisher.finish_flushed`, `finish_durable`),
and every new connection first moves the
sequences this process took or saw IDs from back up to the largest it knows
(`storage/identity.py`, `_catch_up_sequences`; after a crash every statement runs on a
new connection; a head another process reports soon after a restart, perhaps said
before the crash, is caught up before a writer's next statement). `get_next_txn`'s
IDs finish at COMMIT when the WAL is on disk past them (read in the same round trip),
else after a flush.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from plait.core.id_sets import AscendingIds, IdSet, MinMultiset
from plait.errors import PlaitError


class PositionError(PlaitError):
    """An event broke the tracker's contract (an ID completed twice, a fetch ended twice):
    a bug in plait or a sequence that went back, never the caller's input."""


class SequenceWentBackwardsError(PositionError):
    """A fetch returned an ID at or below one already seen: the sequence was reset."""


@dataclass(frozen=True, slots=True)
class FetchTicket:
    """A fetch of IDs in flight. Every ID it can return is at least `floor`."""

    serial: int
    floor: int


class PositionTracker:
    """Positions of one stream's writers as seen by `instance`.

    `writers` is the configured writer list; `None` means any instance may write (and
    so this one is a writer too). `floor` is persisted-up-to as loaded at start-up,
    `positions` the writer positions loaded from the database, and `completed` IDs
    above the floor known to have completed (rows seen in the tables).
    """

    def __init__(
        self,
        instance: str,
        *,
        writers: Collection[str] | None,
        floor: int,
        positions: Mapping[str, int] | None = None,
        completed: Iterable[int] = (),
        seat: bool = True,
    ) -> None:
        self._instance = instance
        self._writers = None if writers is None else frozenset(writers)
        self._is_writer = writers is None or instance in writers
        self._positions: dict[str, int] = dict(positions or {})
        # The lowest position of the other writers, kept because every write needs it.
        self._others_min: int | None = None
        self._persisted = floor
        # Completed IDs above persisted-up-to, to skip forward over gapless runs.
        self._known_completed = AscendingIds()
        self._max_seen = max([floor, *self._positions.values()])

        self._unfinished = IdSet()
        # Local IDs completed while a smaller local ID was still unfinished.
        self._finished_above: list[int] = []
        self._in_flight = MinMultiset()
        self._last_completed = 0
        self._open_tickets: set[int] = set()
        self._next_serial = 0

        for stream_id in sorted(completed):
            self._note_completed(stream_id)
        # The local writer has nothing in flight yet, so every completed ID it has seen
        # is a safe position for it (`_settle` applies that while it stays idle).
        self._local = self._persisted
        self._seated = False
        self._note_others()
        self._settle()
        if seat:
            self.seat_writers()

    def seat_writers(self) -> None:
        """End of loading: writers without a known position start at persisted-up-to.

        Start-up feeds rows seen in the tables to `observe_completed` before this, so
        new writers start as far ahead as those rows allow (never at 0).
        """
        if self._seated:
            return
        self._seated = True
        if self._is_writer:
            # Nothing of ours is pending at start: our position is the largest ID we
            # know completed, even when the row stored for us is older (a restart),
            # so `positions()` and `position_of` start out agreeing, as in Synapse.
            stored = self._positions.get(self._instance, self._local)
            self._positions[self._instance] = max(stored, self._local)
        if self._writers is not None:
            for writer in sorted(self._writers):
                self._positions.setdefault(writer, self._persisted)
        self._note_others()
        self._settle()

    # -- events ---------------------------------------------------------------------

    def begin_fetch(self) -> FetchTicket:
        """Record that IDs are about to be requested from the sequence.

        Until `end_fetch`, the local position cannot pass what the fetch may return.
        """
        if not self._is_writer:
            raise PositionError(f"{self._instance!r} is not a writer of this stream")
        ticket = FetchTicket(serial=self._next_serial, floor=self._max_seen + 1)
        self._next_serial += 1
        self._open_tickets.add(ticket.serial)
        self._in_flight.add(ticket.floor)
        return ticket

    def end_fetch(
        self, ticket: FetchTicket, ids: Iterable[int], *, completed: bool = False
    ) -> None:
        """The fetch returned `ids` (none if it failed); they are now unfinished.

        With `completed`, the IDs are already finished too (a statement that took its own
        IDs and committed): the same as `end_fetch` then `complete`, in one step.
        """
        if ticket.serial not in self._open_tickets:
            raise PositionError(f"fetch {ticket.serial} already ended")
        self._open_tickets.discard(ticket.serial)
        self._in_flight.remove(ticket.floor)
        got = list(ids)
        if got and min(got) < ticket.floor:
            self._recompute_local()
            self._settle()
            raise SequenceWentBackwardsError(
                f"the sequence returned {min(got)}, but IDs up to {ticket.floor - 1} were "
                "already seen: it has been reset or moved backwards"
            )
        if completed:
            self._record_finished(got)
            return
        if got:
            got.sort()
            repeated = self._unfinished.add_all(got)
            if repeated is not None:
                self._recompute_local()
                self._settle()
                raise PositionError(f"ID {repeated} returned twice by the sequence")
            self._max_seen = max(self._max_seen, got[-1])
        self._recompute_local()
        self._settle()

    def complete(self, ids: Iterable[int]) -> None:
        """Local IDs finished (committed or rolled back)."""
        done = sorted(ids)
        if done:
            stray = self._unfinished.remove_all(done)
            if stray is not None:
                raise PositionError(f"ID {stray} completed but was not unfinished")
        self._record_finished(done)

    def advance(self, writer: str, position: int) -> None:
        """Another writer reports it is at `position` (never moves anything back)."""
        if writer == self._instance and self._is_writer:
            return  # our own position only moves by our own completions
        if position > self._positions.get(writer, position - 1):
            self._positions[writer] = position
            self._note_others()
        self._note_completed(position)
        self._settle()

    def observe_completed(self, ids: Iterable[int]) -> None:
        """IDs seen completed elsewhere (for example committed rows read from a table)."""
        seen = sorted(set(ids))
        if seen:
            self._max_seen = max(self._max_seen, seen[-1])
            self._known_completed.add_all(seen[bisect_right(seen, self._persisted) :])
        self._settle()

    def learn_completed(self, stream_id: int) -> None:
        """A completed ID learned other than by its rows arriving (another writer's
        stored position, or its position heard before the rows before it were
        handled), for the idle rule (R-ID-5) only: it moves no other writer's position and is not
        among the IDs persisted-up-to skips over; both promise that rows reached this
        instance."""
        if stream_id > self._max_seen:
            self._max_seen = stream_id
            self._settle()

    # -- queries --------------------------------------------------------------------

    @property
    def is_writer(self) -> bool:
        return self._is_writer

    @property
    def persisted_upto(self) -> int:
        return self._persisted

    @property
    def max_seen(self) -> int:
        """The largest ID seen allocated or completed anywhere."""
        return self._max_seen

    @property
    def local_position(self) -> int:
        """What this instance reports for itself: idle-advanced, never backwards."""
        return self._local if self._is_writer else self._persisted

    @property
    def last_local_write(self) -> int:
        """The local position from local completions only (not idle-advanced)."""
        return self._positions.get(self._instance, self._persisted)

    @property
    def last_completed(self) -> int:
        """The largest local ID completed so far (others below it may still be running):
        a reader that has seen this writer reach it has seen every completed local
        write, which is what read-your-writes needs."""
        return max(self._last_completed, self.last_local_write)

    @property
    def holds_ids(self) -> bool:
        """Whether IDs were handed out here and not finished (fetches in flight aside)."""
        return bool(self._unfinished.live)

    @property
    def is_idle(self) -> bool:
        # The sets' insides, not len(): this runs several times per write.
        return not self._unfinished.live and not self._in_flight.size

    def position_of(self, writer: str) -> int:
        """A safe position for `writer`; unknown writers are at persisted-up-to."""
        if writer == self._instance and self._is_writer:
            return self._local
        return max(self._positions.get(writer, self._persisted), self._persisted)

    def positions(self) -> dict[str, int]:
        return dict(self._positions)

    def unfinished(self) -> list[int]:
        return self._unfinished.sorted()

    @property
    def lowest_unfinished(self) -> int | None:
        """The lowest local ID handed out and not finished (what holds this writer)."""
        return self._unfinished.min()

    def fetches_in_flight(self) -> int:
        return len(self._in_flight)

    # -- internals ------------------------------------------------------------------

    def _record_finished(self, done: list[int]) -> None:
        """Local IDs that finished: move the local position and persisted-up-to."""
        done.sort()  # callers pass them sorted nearly always: then this is one pass
        finished = self._finished_above
        if self.is_idle:
            # Nothing pending: `_recompute_local` takes the largest finished ID and
            # clears the rest, so only the largest of these matters (the common case).
            finished.extend(done[-1:])
        elif len(done) * 8 < len(finished):
            # A few IDs joining many held back by a slow one: push, don't re-heapify.
            for stream_id in done:
                heapq.heappush(finished, stream_id)
        else:
            finished.extend(done)
            heapq.heapify(finished)
        if done:
            self._max_seen = max(self._max_seen, done[-1])
            if done[-1] > self._last_completed:
                self._last_completed = done[-1]
        self._recompute_local()
        self._settle(done)

    def _note_others(self) -> None:
        """Re-derive the other writers' lowest position (after one of them changed)."""
        others = [p for w, p in self._positions.items() if w != self._instance]
        self._others_min = min(others) if others else None

    def _note_completed(self, stream_id: int) -> None:
        self._max_seen = max(self._max_seen, stream_id)
        if stream_id > self._persisted:
            self._known_completed.add(stream_id)

    def _recompute_local(self) -> None:
        """Move the local position to the largest finished ID below anything pending."""
        if not self._is_writer:
            return
        new = None
        finished = self._finished_above
        if self.is_idle:
            # Nothing pending: every finished ID is covered (the common, fast case).
            new = max(finished, default=None)
            finished.clear()
        else:
            bound = min(b for b in (self._unfinished.min(), self._in_flight.min()) if b is not None)
            while finished and finished[0] < bound:
                new = heapq.heappop(finished)
        if new is not None and new > self._positions.get(self._instance, new - 1):
            self._positions[self._instance] = new
        self._local = max(self._local, self._positions.get(self._instance, self._local))

    def _settle(self, completed: list[int] | None = None) -> None:
        """Re-derive the local reported position and persisted-up-to.

        `completed` are newly completed IDs, ascending (their `max_seen` already noted);
        only those above the new persisted-up-to need to be kept.
        """
        if self._is_writer and self.is_idle:
            self._local = max(self._local, self._max_seen)
        low = self._others_min
        if self._is_writer and (low is None or self._local < low):
            low = self._local
        # Until seated, a configured writer without a known position may still have
        # anything above persisted-up-to unfinished: it holds persisted-up-to back.
        if not self._seated and any(
            w not in self._positions and w != self._instance for w in self._writers or ()
        ):
            low = self._persisted
        if low is not None and low > self._persisted:
            self._persisted = low
        persisted = self._persisted
        if completed:
            self._known_completed.add_all(completed[bisect_right(completed, persisted) :])
        self._persisted = self._known_completed.skip(persisted)
