"""`PendingAges` against a model of one writer's fetches and IDs (pure, no database).

A fetch begins at some time, ends later with a run of fresh IDs (or none: it failed, or
its IDs finished with it), and the IDs then finish in any order. The model keeps every
pending ID with its fetch's start time; the answer must be the earlier of the oldest
fetch in flight and the start of the fetch that took the lowest unfinished ID.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from plait.core.pending_ages import PendingAges
from plait.core.positions import FetchTicket, PositionTracker

# (kind, argument): begin a fetch; end the k-th open fetch with n IDs; finish the k-th
# pending ID; ask.
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("begin"), st.integers(0, 3)),
        st.tuples(st.just("end"), st.tuples(st.integers(0, 5), st.integers(0, 4))),
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("ask"), st.just(0)),
    ),
    max_size=80,
)


@given(_OPS)
def test_answers_when_the_work_holding_the_position_began(ops: list[tuple[str, Any]]) -> None:
    ages = PendingAges()
    tracker = PositionTracker("w", writers=["w"], floor=1)
    now = 0.0
    open_fetches: list[tuple[FetchTicket, float]] = []  # (ticket, began), in begin order
    pending: dict[int, float] = {}  # ID -> when its fetch began
    taken: list[int] = []  # the last ID of each batch taken

    for kind, arg in ops:
        now += 1.0
        if kind == "begin":
            ticket = tracker.begin_fetch()
            ages.began(ticket.serial, now)
            open_fetches.append((ticket, now))
        elif kind == "end" and open_fetches:
            k, n = arg
            ticket, began = open_fetches.pop(k % len(open_fetches))
            first = tracker.max_seen + 1  # the sequence hands out fresh IDs in a run
            ids = list(range(first, first + n))
            tracker.end_fetch(ticket, ids)
            ages.ended(ticket.serial, ids, tracker.lowest_unfinished)
            pending.update(dict.fromkeys(ids, began))
            taken.extend(ids[-1:])
        elif kind == "finish" and pending:
            stream_id = sorted(pending)[arg % len(pending)]
            del pending[stream_id]
            tracker.complete([stream_id])
        lowest = tracker.lowest_unfinished
        assert lowest == min(pending, default=None)
        expected = [began for _, began in open_fetches[:1]]
        if lowest is not None:
            expected.append(pending[lowest])
        assert ages.oldest(lowest) == min(expected, default=None)
        # Memory: only batches from the one holding the lowest unfinished ID on.
        kept = 0 if lowest is None else sum(1 for last in taken if last >= lowest)
        assert len(ages._batches) <= kept
        assert len(ages._fetches) == len(open_fetches)


def test_a_failed_fetch_leaves_nothing_pending() -> None:
    ages = PendingAges()
    ages.began(0, 5.0)
    assert ages.oldest(None) == 5.0
    ages.ended(0, [], None)
    assert ages.oldest(None) is None


def test_batches_arriving_out_of_order_stay_sorted() -> None:
    ages = PendingAges()
    ages.began(0, 1.0)
    ages.began(1, 2.0)
    ages.ended(1, [20, 21], 20)  # the later fetch returned first, with higher IDs
    ages.ended(0, [10, 11], 10)
    assert ages.oldest(10) == 1.0
    assert ages.oldest(20) == 2.0  # 10 and 11 finished
    assert ages.oldest(None) is None
