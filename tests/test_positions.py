"""`PositionTracker` against a global model of one stream (pure, no database).

The stateful test runs 1-5 writers, each with its own tracker, plus pure readers. IDs
come from one simulated sequence; a fetch draws its IDs at any time between
`begin_fetch` and `end_fetch`, interleaved with other fetches. Writers announce their
positions as messages that are delivered later, out of order and sometimes twice. The
model knows which IDs exist, whose they are and which completed, and after every step
every tracker is checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from plait.core.id_sets import AscendingIds, IdSet
from plait.core.positions import (
    FetchTicket,
    PositionError,
    PositionTracker,
    SequenceWentBackwardsError,
)

UNKNOWN = "never-announced"


@dataclass
class Fetch:
    writer: str
    ticket: FetchTicket
    drawn: list[int] = field(default_factory=list)


@dataclass
class Snapshot:
    """What a tracker showed after the previous step (nothing may move backwards)."""

    persisted: int
    local: int
    position_of: dict[str, int]
    positions: dict[str, int]


class TrackerNetwork(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.trackers: dict[str, PositionTracker] = {}
        self.writers: list[str] = []
        self.floor = 0
        self.head = 0  # the last value the sequence handed out
        self.owner: dict[int, str] = {}  # every ID the sequence handed out -> its writer
        self.completed: set[int] = set()
        self.rows: set[int] = set()  # committed IDs: they have rows in the tables
        self.returned: set[int] = set()  # IDs some tracker was given by end_fetch
        self.unfinished: dict[str, set[int]] = {}
        self.fetches: list[Fetch] = []
        self.messages: list[tuple[str, str, int]] = []  # (from writer, to tracker, position)
        self.stored: dict[str, int] = {}  # stream_positions
        self.last_read: dict[str, int] = {}  # per tracker: a linear reader's position
        self.snapshots: dict[str, Snapshot] = {}
        self.n_readers = 0

    # -- model helpers ------------------------------------------------------------------

    def done(self, stream_id: int) -> bool:
        return stream_id <= self.floor or stream_id in self.completed

    def pending(self, writer: str) -> set[int]:
        """The writer's IDs not completed: unfinished, or drawn by a fetch still open."""
        drawn = {i for f in self.fetches if f.writer == writer for i in f.drawn}
        return self.unfinished[writer] | drawn

    def true_persisted(self) -> int:
        position = self.floor
        while position < self.head and self.done(position + 1):
            position += 1
        return position

    def add_tracker(self, name: str, tracker: PositionTracker) -> None:
        self.trackers[name] = tracker
        self.last_read[name] = tracker.persisted_upto
        self.snapshots.pop(name, None)

    # -- rules --------------------------------------------------------------------------

    @initialize(
        n_writers=st.integers(1, 5),
        n_readers=st.integers(1, 2),
        floor=st.integers(0, 3),
        seat_late=st.booleans(),
    )
    def start(self, n_writers: int, n_readers: int, floor: int, seat_late: bool) -> None:
        self.writers = [f"w{i}" for i in range(n_writers)]
        self.floor = self.head = floor
        for w in self.writers:
            self.unfinished[w] = set()
            self.stored[w] = floor
        names = self.writers + [f"r{i}" for i in range(n_readers)]
        self.n_readers = n_readers
        for name in names:
            tracker = PositionTracker(name, writers=self.writers, floor=floor, seat=not seat_late)
            if seat_late:
                tracker.seat_writers()
            self.add_tracker(name, tracker)

    @rule(data=st.data())
    def begin_fetch(self, data: st.DataObject) -> None:
        writer = data.draw(st.sampled_from(self.writers), label="writer")
        if sum(f.writer == writer for f in self.fetches) >= 3:
            return
        ticket = self.trackers[writer].begin_fetch()
        # Every ID the fetch can still draw is above the sequence head, so the floor is
        # never above what the sequence will return.
        assert ticket.floor <= self.head + 1
        self.fetches.append(Fetch(writer, ticket))

    @rule(data=st.data(), n=st.integers(1, 3))
    def allocate(self, data: st.DataObject, n: int) -> None:
        """A whole fetch in one step: begin, draw `n` IDs, end (the common case)."""
        writer = data.draw(st.sampled_from(self.writers), label="writer")
        tracker = self.trackers[writer]
        ticket = tracker.begin_fetch()
        ids = list(range(self.head + 1, self.head + n + 1))
        self.head += n
        for stream_id in ids:
            self.owner[stream_id] = writer
        tracker.end_fetch(ticket, ids)
        self.unfinished[writer].update(ids)
        self.returned.update(ids)

    @precondition(lambda self: self.fetches)
    @rule(data=st.data(), n=st.integers(1, 3))
    def sequence_hands_out(self, data: st.DataObject, n: int) -> None:
        """An open fetch draws IDs from the shared sequence (possibly interleaved)."""
        fetch = data.draw(st.sampled_from(self.fetches), label="fetch")
        for _ in range(n):
            self.head += 1
            fetch.drawn.append(self.head)
            self.owner[self.head] = fetch.writer

    @precondition(lambda self: self.fetches)
    @rule(data=st.data(), fails=st.booleans(), done=st.booleans())
    def end_fetch(self, data: st.DataObject, fails: bool, done: bool) -> None:
        fetch = data.draw(st.sampled_from(self.fetches), label="fetch")
        self.fetches.remove(fetch)
        tracker = self.trackers[fetch.writer]
        if done and not fails:
            # A statement that took its own IDs and committed (`insert`): fetched and
            # completed in one step.
            ids = data.draw(st.permutations(fetch.drawn), label="ids")
            for stream_id in ids:
                for name, last in self.last_read.items():
                    assert stream_id > last, f"{name} read up to {last} before {stream_id}"
            tracker.end_fetch(fetch.ticket, ids, completed=True)
            self.returned.update(ids)
            self.completed.update(ids)
            self.rows.update(ids)
            if ids:
                self.store(fetch.writer)
            return
        if fails:
            # The round trip failed after the sequence moved: those IDs are burnt. Nobody
            # will ever write them, so they count as completed (with no rows).
            tracker.end_fetch(fetch.ticket, [])
            self.completed.update(fetch.drawn)
        else:
            ids = data.draw(st.permutations(fetch.drawn), label="ids")
            tracker.end_fetch(fetch.ticket, ids)
            self.unfinished[fetch.writer].update(ids)
            self.returned.update(ids)

    @precondition(lambda self: any(self.unfinished.values()))
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        busy = [w for w in self.writers if self.unfinished[w]]
        writer = data.draw(st.sampled_from(busy), label="writer")
        ids = data.draw(
            st.lists(st.sampled_from(sorted(self.unfinished[writer])), min_size=1, unique=True),
            label="ids",
        )
        committed = data.draw(
            st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)), label="committed"
        )
        for stream_id in ids:
            # No linear reader has read past an ID that only completes now.
            for name, last in self.last_read.items():
                assert stream_id > last, f"{name} read up to {last} before {stream_id} completed"
        self.trackers[writer].complete(ids)
        for stream_id, commit in zip(ids, committed, strict=True):
            self.unfinished[writer].discard(stream_id)
            self.completed.add(stream_id)
            if commit:
                self.rows.add(stream_id)
        if any(committed):
            # After a successful write the writer upserts its position (R-ID-8).
            self.store(writer)

    @rule(data=st.data())
    def announce(self, data: st.DataObject) -> None:
        writer = data.draw(st.sampled_from(self.writers), label="writer")
        others = sorted(n for n in self.trackers if n != writer)
        if not others:
            return
        to = data.draw(st.lists(st.sampled_from(others), min_size=1, unique=True), label="to")
        position = self.trackers[writer].position_of(writer)
        self.messages.extend((writer, receiver, position) for receiver in to)

    @precondition(lambda self: self.messages)
    @rule(data=st.data(), duplicate=st.booleans())
    def deliver(self, data: st.DataObject, duplicate: bool) -> None:
        """Deliver any queued message; a duplicated one stays queued to arrive again."""
        index = data.draw(st.integers(0, len(self.messages) - 1), label="message")
        writer, receiver, position = self.messages[index]
        if not duplicate:
            del self.messages[index]
        self.trackers[receiver].advance(writer, position)

    @precondition(lambda self: self.messages)
    @rule(newest_first=st.booleans())
    def deliver_all(self, newest_first: bool) -> None:
        queued = self.messages[::-1] if newest_first else self.messages
        self.messages = []
        for writer, receiver, position in queued:
            self.trackers[receiver].advance(writer, position)

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def observe_rows(self, data: st.DataObject) -> None:
        """A tracker sees committed rows in the tables."""
        name = data.draw(st.sampled_from(sorted(self.trackers)), label="tracker")
        ids = data.draw(st.lists(st.sampled_from(sorted(self.rows)), unique=True), label="ids")
        self.trackers[name].observe_completed(ids)

    @rule(data=st.data())
    def store_position(self, data: st.DataObject) -> None:
        """An idle writer flushes its position to stream_positions (only ever forwards)."""
        self.store(data.draw(st.sampled_from(self.writers), label="writer"))

    @rule(data=st.data())
    def learn_stored_positions(self, data: st.DataObject) -> None:
        """A writer that cannot hear the others reads their stored positions (plait does
        when replicated and idle): completed IDs, for its idle rule only."""
        writer = data.draw(st.sampled_from(self.writers), label="writer")
        stored = [p for w, p in self.stored.items() if w != writer]
        if not stored:
            return
        tracker = self.trackers[writer]
        persisted, others = tracker.persisted_upto, tracker.positions()
        tracker.learn_completed(data.draw(st.sampled_from(stored), label="stored"))
        # Never anyone else's position, nor persisted-up-to past them: those promise that
        # rows reached this instance, which only replication (or a read) makes true.
        assert {w: p for w, p in tracker.positions().items() if w != writer} == {
            w: p for w, p in others.items() if w != writer
        }
        heard = [p for w, p in others.items() if w != writer]
        assert tracker.persisted_upto <= max(persisted, min(heard, default=persisted))

    def store(self, writer: str) -> None:
        position = self.trackers[writer].position_of(writer)
        self.stored[writer] = max(self.stored[writer], position)

    @precondition(lambda self: self.completed and self.n_readers < 5)
    @rule(data=st.data(), seat_late=st.booleans())
    def reader_starts(self, data: st.DataObject, seat_late: bool) -> None:
        """A new reader loads stream_positions and the rows above them.

        Some writers' rows may be missing from what it loads; `floor` is still a sound
        persisted-up-to, so those writers must be seated at no more than what the floor
        and the rows prove, whatever the other writers' positions say.
        """
        name = f"r{self.n_readers}"
        self.n_readers += 1
        # Any floor at or below the true persisted-up-to is sound; plait loads the least
        # stored position, which always is.
        # (Capped at the largest ID a tracker was given: burnt IDs stay unknown.)
        top = min(self.true_persisted(), max(self.returned, default=self.floor))
        floor = data.draw(
            st.sampled_from([min(self.stored.values()), top]) | st.integers(self.floor, top),
            label="floor",
        )
        loaded = data.draw(st.sets(st.sampled_from(self.writers)), label="loaded")
        positions = {w: self.stored[w] for w in loaded}
        above = sorted(i for i in self.rows if i > floor)
        seen = (
            data.draw(st.lists(st.sampled_from(above), unique=True), label="rows") if above else []
        )
        if seat_late:
            tracker = PositionTracker(
                name, writers=self.writers, floor=floor, positions=positions, seat=False
            )
            tracker.observe_completed(seen)
            tracker.seat_writers()
        else:
            tracker = PositionTracker(
                name, writers=self.writers, floor=floor, positions=positions, completed=seen
            )
        self.add_tracker(name, tracker)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def trackers_agree_with_the_model(self) -> None:
        for name, tracker in self.trackers.items():
            self.check_tracker(name, tracker)

    def check_tracker(self, name: str, tracker: PositionTracker) -> None:
        persisted = tracker.persisted_upto
        assert persisted <= self.head
        assert tracker.max_seen <= self.head

        # Soundness of persisted-up-to, and a linear reader reading (last, persisted].
        assert all(self.done(i) for i in range(self.floor + 1, persisted + 1)), (
            name,
            persisted,
        )
        last = self.last_read[name]
        for stream_id in range(last + 1, persisted + 1):
            assert self.done(stream_id), f"{name} would read unfinished {stream_id}"
        self.last_read[name] = max(last, persisted)

        # Soundness of every writer position: all that writer's IDs at or below it completed,
        # and the position itself is a completed ID.
        position_of = {w: tracker.position_of(w) for w in [*self.writers, UNKNOWN]}
        for writer, position in position_of.items():
            assert position <= self.head
            assert self.done(position), (name, writer, position)
        for stream_id, writer in self.owner.items():
            if stream_id <= position_of[writer]:
                assert self.done(stream_id), (name, writer, position_of[writer], stream_id)
        positions = tracker.positions()
        for writer, position in positions.items():
            assert self.done(position), (name, writer, position)
        assert position_of[UNKNOWN] == persisted

        if name in self.writers:
            assert tracker.is_writer
            own = position_of[name]
            assert tracker.local_position == own
            pending = self.pending(name)
            if pending:
                # Below the smallest unfinished ID, and below every ID a fetch drew.
                assert own < min(pending), (name, own, sorted(pending))
                assert tracker.last_local_write < min(pending)
            assert tracker.unfinished() == sorted(self.unfinished[name])
            # Read-your-writes: the largest of this writer's completed IDs (or where
            # the writer started, when it completed none).
            mine = [i for i in self.completed & self.returned if self.owner.get(i) == name]
            assert tracker.last_completed == max([*mine, tracker.last_local_write])
            assert tracker.fetches_in_flight() == sum(f.writer == name for f in self.fetches)
            if tracker.is_idle:
                # An idle writer reports the largest completed ID it has seen anywhere.
                assert own == tracker.max_seen
        else:
            assert not tracker.is_writer
            assert tracker.local_position == persisted

        # Nothing moves backwards.
        before = self.snapshots.get(name)
        if before is not None:
            assert persisted >= before.persisted
            assert tracker.local_position >= before.local
            for writer, position in before.position_of.items():
                assert position_of[writer] >= position, (name, writer)
            for writer, position in before.positions.items():
                assert positions.get(writer, -1) >= position, (name, writer)
        self.snapshots[name] = Snapshot(persisted, tracker.local_position, position_of, positions)

    def teardown(self) -> None:
        """Convergence: once all is complete, two rounds of announcements settle everything."""
        if not self.trackers:
            return
        for fetch in list(self.fetches):
            self.fetches.remove(fetch)
            self.trackers[fetch.writer].end_fetch(fetch.ticket, fetch.drawn)
            self.unfinished[fetch.writer].update(fetch.drawn)
            self.returned.update(fetch.drawn)
        for writer in self.writers:
            if self.unfinished[writer]:
                self.trackers[writer].complete(sorted(self.unfinished[writer], reverse=True))
                self.completed.update(self.unfinished[writer])
                self.unfinished[writer].clear()
        self.trackers_agree_with_the_model()

        # Burnt IDs are in the sequence but no tracker ever hears of them.
        target = max(self.returned, default=self.floor)
        for _ in range(2):
            for writer in self.writers:
                position = self.trackers[writer].position_of(writer)
                for name, tracker in self.trackers.items():
                    if name != writer:
                        tracker.advance(writer, position)
            self.trackers_agree_with_the_model()
        for name, tracker in self.trackers.items():
            assert tracker.persisted_upto == target, (name, tracker.persisted_upto, target)
            if name in self.writers:
                assert tracker.position_of(name) == target
                assert tracker.is_idle
        # Old messages still in the queue change nothing any more.
        for writer, receiver, position in self.messages:
            self.trackers[receiver].advance(writer, position)
        self.trackers_agree_with_the_model()
        assert all(t.persisted_upto == target for t in self.trackers.values())


TrackerNetwork.TestCase.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)
test_tracker_network = TrackerNetwork.TestCase


# -- plain numbers ------------------------------------------------------------------------


def fetch(tracker: PositionTracker, ids: list[int]) -> None:
    tracker.end_fetch(tracker.begin_fetch(), ids)


def test_spec_reserve_and_finish_out_of_order() -> None:
    master = PositionTracker("master", writers=["master"], floor=7)
    assert master.position_of("master") == 7
    fetch(master, [8, 9, 10, 11])
    seen = []
    for stream_id in (9, 8, 11, 10):
        master.complete([stream_id])
        seen.append(master.position_of("master"))
    assert seen == [7, 9, 9, 11]
    assert master.persisted_upto == 11


def test_spec_reader_follows_two_writers() -> None:
    reader = PositionTracker(
        "reader", writers=["first", "second"], floor=3, positions={"first": 3, "second": 5}
    )
    assert reader.persisted_upto == 3
    steps = [
        ("first", 6, 6),
        ("second", 7, 7),
        ("second", 9, 7),
        ("first", 8, 9),
        ("first", 11, 9),  # second is at 9, and 10 was never seen
        ("second", 15, 11),
    ]
    for writer, position, expected in steps:
        reader.advance(writer, position)
        assert reader.persisted_upto == expected, (writer, position)
    assert reader.positions() == {"first": 11, "second": 15}


def test_spec_idle_rule() -> None:
    writers = ["first", "second", "third"]
    second = PositionTracker(
        "second", writers=writers, floor=7, positions={"first": 7, "second": 7}
    )
    second.advance("first", 9)
    assert second.position_of("first") == 9
    assert second.position_of("second") == 9  # idle: at the largest ID seen anywhere
    assert second.persisted_upto == 7  # third is still at 7, and 8 was never seen
    assert second.last_local_write == 7
    # With a local write in flight it does not jump.
    ticket = second.begin_fetch()
    second.advance("first", 12)
    assert second.position_of("second") == 9
    second.end_fetch(ticket, [13])
    assert second.position_of("second") == 9
    second.complete([13])
    assert second.position_of("second") == 13
    assert second.last_local_write == 13


def test_an_idle_writer_follows_completed_ids_learned_elsewhere() -> None:
    """Replication down: the others' stored positions move an idle writer's own position
    (R-ID-5, R-ID-8), and nothing else; a busy writer waits for its own IDs."""
    writers = ["first", "second"]
    first = PositionTracker("first", writers=writers, floor=5, positions={"second": 5})
    first.learn_completed(9)
    assert first.position_of("first") == 9
    assert first.position_of("second") == 5
    assert first.persisted_upto == 5
    first.learn_completed(7)  # older news: nothing moves back
    assert first.position_of("first") == 9
    ticket = first.begin_fetch()
    first.learn_completed(12)
    assert first.position_of("first") == 9  # a fetch in flight holds it
    first.end_fetch(ticket, [13])
    first.complete([13])
    assert first.position_of("first") == 13
    assert ticket.floor == 10


def test_in_flight_fetch_holds_the_position_back() -> None:
    w = PositionTracker("w", writers=["w", "x"], floor=5)
    assert w.position_of("w") == 5
    ticket = w.begin_fetch()
    assert ticket.floor == 6
    # x allocated and completed 6..9 while w's fetch was on its way; w learns of it.
    w.advance("x", 9)
    assert w.position_of("w") == 5  # the fetch may still return 6 (drawn before x's)
    assert w.persisted_upto == 5
    # A second fetch started now can only return IDs above 9.
    later = w.begin_fetch()
    assert later.floor == 10
    w.end_fetch(later, [11])
    w.end_fetch(ticket, [10])
    assert w.position_of("w") == 5
    w.complete([11])
    assert w.position_of("w") == 5
    w.complete([10])
    assert w.position_of("w") == 11
    # x is at 9, and 10 and 11 are w's own completed IDs: a gapless run.
    assert w.persisted_upto == 11


def test_failed_fetch_releases_the_position() -> None:
    w = PositionTracker("w", writers=["w"], floor=1)
    ticket = w.begin_fetch()
    w.advance("other", 4)
    assert w.position_of("w") == 1
    w.end_fetch(ticket, [])
    assert w.is_idle
    assert w.position_of("w") == 4


def test_completing_twice_raises() -> None:
    w = PositionTracker("w", writers=["w"], floor=1)
    fetch(w, [2, 3])
    w.complete([2])
    with pytest.raises(PositionError, match="ID 2 completed but was not unfinished"):
        w.complete([2])
    with pytest.raises(PositionError, match="ID 9 completed"):
        w.complete([9])
    w.complete([3])
    assert w.position_of("w") == 3


def test_end_fetch_twice_raises() -> None:
    w = PositionTracker("w", writers=["w"], floor=1)
    ticket = w.begin_fetch()
    w.end_fetch(ticket, [2])
    with pytest.raises(PositionError, match="already ended") as info:
        w.end_fetch(ticket, [3])
    assert not isinstance(info.value, SequenceWentBackwardsError)
    assert w.unfinished() == [2]
    assert w.fetches_in_flight() == 0


def test_sequence_going_backwards_raises_and_does_not_stick() -> None:
    w = PositionTracker("w", writers=["w", "x"], floor=1)
    fetch(w, [2, 3])
    w.complete([2, 3])
    assert w.position_of("w") == 3
    fetch(w, [4])  # unfinished while the bad fetch happens

    ticket = w.begin_fetch()
    assert ticket.floor == 5
    with pytest.raises(SequenceWentBackwardsError, match="returned 2"):
        w.end_fetch(ticket, [5, 2])
    # Nothing of the bad fetch was kept, and it no longer holds anything back.
    assert w.fetches_in_flight() == 0
    assert w.unfinished() == [4]
    w.complete([4])
    assert w.is_idle
    assert w.position_of("w") == 4
    fetch(w, [5])
    w.complete([5])
    assert w.position_of("w") == 5
    w.advance("x", 5)
    assert w.persisted_upto == 5

    # Same when nothing else is pending: the position is released at once.
    ticket = w.begin_fetch()
    with pytest.raises(SequenceWentBackwardsError):
        w.end_fetch(ticket, [1])
    assert w.is_idle
    w.advance("x", 7)
    assert w.position_of("w") == 7
    assert w.persisted_upto == 7


def test_sequence_returning_an_unfinished_id_again_raises() -> None:
    w = PositionTracker("w", writers=["w"], floor=1)
    first = w.begin_fetch()
    second = w.begin_fetch()  # both started before either returned: same floor
    w.end_fetch(first, [2])
    with pytest.raises(PositionError, match="returned twice"):
        w.end_fetch(second, [2])


def test_reader_cannot_fetch() -> None:
    reader = PositionTracker("r", writers=["w"], floor=1)
    assert not reader.is_writer
    with pytest.raises(PositionError, match="not a writer"):
        reader.begin_fetch()


def test_advance_for_an_unknown_writer() -> None:
    reader = PositionTracker("r", writers=["a"], floor=1)
    assert reader.position_of("zzz") == 1  # unknown writers are at persisted-up-to
    reader.advance("a", 5)
    assert reader.persisted_upto == 5
    assert reader.position_of("zzz") == 5

    reader.advance("zzz", 7)
    assert reader.positions()["zzz"] == 7
    assert reader.position_of("zzz") == 7
    assert reader.persisted_upto == 5  # a is at 5
    assert reader.max_seen == 7
    # An old position of it never drags anything back.
    reader.advance("old", 2)
    assert reader.position_of("old") == 5
    assert reader.persisted_upto == 5
    assert reader.position_of("a") == 5


def test_advance_for_own_name_is_ignored_by_a_writer() -> None:
    w = PositionTracker("w", writers=["w", "x"], floor=1)
    fetch(w, [2])
    before = (w.position_of("w"), w.positions(), w.persisted_upto, w.max_seen)
    w.advance("w", 50)  # say an echo of an old announcement, or a bogus one
    assert (w.position_of("w"), w.positions(), w.persisted_upto, w.max_seen) == before
    w.complete([2])
    assert w.position_of("w") == 2


def test_advance_out_of_order_and_duplicated() -> None:
    reader = PositionTracker("r", writers=["a", "b"], floor=1)
    for position in (6, 3, 6, 2, 6):
        reader.advance("a", position)
        assert reader.position_of("a") == 6
    reader.advance("b", 4)
    reader.advance("b", 4)
    assert reader.persisted_upto == 4
    reader.advance("b", 1)
    assert reader.positions() == {"a": 6, "b": 4}
    assert reader.persisted_upto == 4


def test_seat_late_after_observing_rows() -> None:
    # Loaded: b's position row is missing, a is at 9; persisted-up-to was 5. Rows 6, 7
    # and 9 are in the tables; 8 is not (b may still be writing it).
    reader = PositionTracker("r", writers=["a", "b"], floor=5, positions={"a": 9}, seat=False)
    assert reader.positions() == {"a": 9}
    reader.observe_completed([9, 7, 6])
    assert reader.persisted_upto == 7
    reader.seat_writers()
    assert reader.positions() == {"a": 9, "b": 7}
    assert reader.position_of("b") == 7
    reader.seat_writers()  # a second call changes nothing
    assert reader.positions() == {"a": 9, "b": 7}
    assert reader.persisted_upto == 7
    reader.advance("b", 8)
    assert reader.persisted_upto == 9


def test_floor_holds_until_every_writer_is_known() -> None:
    """A writer with no known position holds persisted-up-to at the loaded floor.

    The inputs are sound (b's 6 may be unfinished: a being at 8 says nothing about b), so
    persisted-up-to must not jump to 8 just because a is the only position loaded.
    """
    reader = PositionTracker("r", writers=["a", "b"], floor=5, positions={"a": 8})
    assert reader.persisted_upto == 5
    assert reader.position_of("b") == 5
    writer = PositionTracker("c", writers=["a", "b", "c"], floor=5, positions={"a": 8})
    assert writer.persisted_upto == 5
    assert writer.position_of("c") == 8  # c itself has nothing unfinished


def test_seat_late_writer() -> None:
    w = PositionTracker("w", writers=["w", "a"], floor=3, positions={"a": 3}, seat=False)
    w.observe_completed([4, 5])
    assert w.persisted_upto == 5
    w.seat_writers()
    assert w.positions() == {"a": 3, "w": 5}
    assert w.position_of("w") == 5
    assert w.last_local_write == 5


def test_any_writer_mode() -> None:
    x = PositionTracker("x", writers=None, floor=1)
    y = PositionTracker("y", writers=None, floor=1)
    assert x.is_writer
    assert y.is_writer
    assert x.positions() == {"x": 1}
    fetch(x, [2])
    fetch(y, [3])
    y.complete([3])
    x.advance("y", y.position_of("y"))
    assert x.position_of("y") == 3
    assert x.persisted_upto == 1  # x's own 2 is unfinished
    assert x.position_of("x") == 1
    x.complete([2])
    assert x.position_of("x") == 3  # idle: the largest ID seen
    assert x.persisted_upto == 3
    y.advance("x", x.position_of("x"))
    assert y.persisted_upto == 3
    # Anyone may advance; nobody is configured, so nobody else is assumed.
    y.advance("z", 3)
    assert y.positions() == {"x": 3, "y": 3, "z": 3}


def test_largest_id_rolled_back_still_converges() -> None:
    writers = ["a", "b"]
    a = PositionTracker("a", writers=writers, floor=1)
    b = PositionTracker("b", writers=writers, floor=1)
    reader = PositionTracker("r", writers=writers, floor=1)
    fetch(b, [2, 3])
    fetch(a, [4])  # the largest ID; it will roll back
    b.complete([3, 2])
    a.complete([4])  # a rollback completes too
    for _ in range(2):
        for name, tracker in (("a", a), ("b", b)):
            for other in (a, b, reader):
                if other is not tracker:
                    other.advance(name, tracker.position_of(name))
    assert [t.persisted_upto for t in (a, b, reader)] == [4, 4, 4]


def test_a_starting_writer_does_not_claim_the_sequence_head() -> None:
    """Why a starting writer reports the largest ID it knows completed, not the head.

    X has ID H in flight; its position is H-1; the sequence head is H. If a starting
    writer W said "W is at H", a reader would take H as completed (a position is a
    completed ID) and skip over it on the gapless-run rule, though X has not finished H:
    X's row at H would never be read.
    """
    h = 10
    writers = ["x", "w"]
    x = PositionTracker("x", writers=writers, floor=h - 1)
    fetch(x, [h])
    assert x.position_of("x") == h - 1

    naive = PositionTracker("r", writers=writers, floor=h - 1)
    naive.advance("x", x.position_of("x"))
    naive.advance("w", h)  # "W is at the head"
    assert naive.persisted_upto == h  # stepped over H ...
    assert h in x.unfinished()  # ... which is still unfinished: unsound

    # What the tracker gives a starting W: loaded positions, no row at H (not committed).
    w = PositionTracker("w", writers=writers, floor=h - 1, positions={"x": h - 1}, seat=False)
    w.observe_completed([])
    w.seat_writers()
    assert w.position_of("w") == h - 1
    assert w.position_of("w") != h
    reader = PositionTracker("r", writers=writers, floor=h - 1)
    reader.advance("w", w.position_of("w"))
    reader.advance("x", x.position_of("x"))
    assert reader.persisted_upto == h - 1

    # With rows above H committed by a third writer, W's position is the largest ID known
    # complete (H+1): that is safe, and readers still wait for X's H.
    writers3 = ["x", "y", "w"]
    w3 = PositionTracker(
        "w", writers=writers3, floor=h - 1, positions={"x": h - 1, "y": h - 1}, completed=[h + 1]
    )
    assert w3.position_of("w") == h + 1
    reader3 = PositionTracker("r", writers=writers3, floor=h - 1)
    reader3.advance("w", w3.position_of("w"))
    reader3.advance("y", h + 1)
    reader3.advance("x", h - 1)
    assert reader3.persisted_upto == h - 1
    x.complete([h])
    reader3.advance("x", x.position_of("x"))
    assert reader3.persisted_upto == h + 1


_ID_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 60)),
        st.tuples(st.just("add_all"), st.lists(st.integers(0, 60), max_size=8).map(sorted)),
        st.tuples(st.just("skip"), st.integers(0, 60)),
    ),
    max_size=60,
)


@given(_ID_OPS)
def test_ascending_ids_skip_like_a_set(ops: list[tuple[str, object]]) -> None:
    """The gap-skipping store agrees with the obvious model: from p, step to p + 1
    while p + 1 is known; everything at or below the result is forgotten."""
    store = AscendingIds()
    model: set[int] = set()
    for op, arg in ops:
        if op == "add":
            assert isinstance(arg, int)
            store.add(arg)
            model.add(arg)
        elif op == "add_all":
            assert isinstance(arg, list)
            store.add_all(arg)
            model.update(arg)
        else:
            assert isinstance(arg, int)
            expected = arg
            while expected + 1 in model:
                expected += 1
            assert store.skip(arg) == expected
            model = {i for i in model if i > expected}
        assert len(store) >= len(model)  # duplicates may be kept until skipped over


_SET_OPS = st.lists(
    st.tuples(
        st.sampled_from(["add_all", "remove_all", "min"]),
        st.lists(st.integers(0, 40), max_size=6).map(sorted),
    ),
    max_size=60,
)


@given(_SET_OPS)
def test_unfinished_id_set_is_a_set_with_its_minimum(ops: list[tuple[str, list[int]]]) -> None:
    """Batches in and out, in any order; a bad batch (an ID present twice, or missing)
    changes nothing and names the first offending ID."""
    ids = IdSet()
    model: set[int] = set()
    for op, values in ops:
        if op == "add_all":
            bad = [v for i, v in enumerate(values) if v in model or v in values[:i]]
            assert ids.add_all(values) == (bad[0] if bad else None)
            if not bad:
                model.update(values)
        elif op == "remove_all":
            bad = [v for i, v in enumerate(values) if v not in model or v in values[:i]]
            assert ids.remove_all(values) == (bad[0] if bad else None)
            if not bad:
                model.difference_update(values)
        assert ids.min() == min(model, default=None)
        assert len(ids) == len(model)
        assert ids.sorted() == sorted(model)


@given(
    stored=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(1, 50), min_size=1),
    completed=st.lists(st.integers(1, 60), max_size=5),
)
def test_starting_writer_reads_agree(stored: dict[str, int], completed: list[int]) -> None:
    """A writer that just started has nothing pending: `positions()` and `position_of`
    say the same of it (issue 18, finding 9: Synapse's restart test gave 3 and 5)."""
    floor = min(stored.values())
    tracker = PositionTracker(
        "a", writers=["a", "b", "c"], floor=floor, positions=stored, completed=completed
    )
    assert tracker.positions()["a"] == tracker.position_of("a") == tracker.local_position
    assert tracker.positions()["a"] >= stored.get("a", floor)
