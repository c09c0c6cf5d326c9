"""A connection's departures (`plait.replication.departures`), with no I/O: a departure's
listeners may run only once every stream it waited for handled it, oldest first."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from plait.core.inbound import Departure
from plait.replication.departures import Departures


def test_a_departure_that_waits_for_no_stream_is_done_at_once() -> None:
    assert Departures().begin("w2", []).done.is_set()


def test_a_departure_is_done_once_every_stream_handled_it() -> None:
    departures = Departures()
    departing = departures.begin("w2", ["a", "b"])
    departures.handled(Departure("a", "w2"))
    assert not departing.done.is_set()
    departures.handled(Departure("a", "w2"))  # a second one of `a` counts for nothing
    assert not departing.done.is_set()
    departures.handled(Departure("b", "w3"))  # another writer's
    assert not departing.done.is_set()
    departures.handled(Departure("b", "w2"))
    assert departing.done.is_set()


STREAMS = st.lists(st.sampled_from("abc"), unique=True, max_size=3)


@settings(max_examples=300, deadline=None)
@given(st.lists(STREAMS, min_size=1, max_size=6), st.data())
def test_departures_end_in_order_and_only_when_every_stream_got_there(
    waits: list[list[str]], data: st.DataObject
) -> None:
    """Departures of one writer, each waiting for some streams; each stream handles its
    `Departure`s in queue order, folded into counts as an overflowed backlog folds
    them. A departure is done exactly when each stream it waited for handled as many
    departures as were queued on it up to and including this one."""
    departures = Departures()
    begun = [departures.begin("w2", streams) for streams in waits]
    queued = {s: [i for i, streams in enumerate(waits) if s in streams] for s in "abc"}
    handled = dict.fromkeys("abc", 0)
    while any(handled[s] < len(queued[s]) for s in "abc"):
        stream = data.draw(st.sampled_from([s for s in "abc" if handled[s] < len(queued[s])]))
        count = data.draw(st.integers(1, len(queued[stream]) - handled[stream]))
        departures.handled(Departure(stream, "w2", count))
        handled[stream] += count
        for i, streams in enumerate(waits):
            due = all(handled[s] > queued[s].index(i) for s in streams)
            assert begun[i].done.is_set() == due
