"""The sets of IDs a position tracker keeps, each shaped for what it asks of them
(`plait.core.positions`). Pure: no I/O.

- `MinMultiset`: values with repeats, smallest first (in-flight fetch floors).
- `IdSet`: a set of IDs whose smallest is asked for often (unfinished IDs).
- `AscendingIds`: IDs known complete above the persisted-up-to, skipped over in
  gapless runs.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right, insort
from collections.abc import Callable


class MinMultiset:
    """A multiset of ints with O(log n) add, remove and min (a heap with lazy deletion)."""

    __slots__ = ("_counts", "_heap", "size")

    def __init__(self) -> None:
        self._heap: list[int] = []
        self._counts: dict[int, int] = {}
        self.size = 0  # read directly on the hot path, as `len` costs a call

    def add(self, value: int) -> None:
        count = self._counts.get(value, 0)
        if count == 0:
            heapq.heappush(self._heap, value)
        self._counts[value] = count + 1
        self.size += 1

    def remove(self, value: int) -> bool:
        count = self._counts.get(value, 0)
        if count == 0:
            return False
        if count == 1:
            del self._counts[value]
        else:
            self._counts[value] = count - 1
        self.size -= 1
        return True

    def __contains__(self, value: int) -> bool:
        return value in self._counts

    def __len__(self) -> int:
        return self.size

    def min(self) -> int | None:
        heap = self._heap
        while heap and heap[0] not in self._counts:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def sorted(self) -> list[int]:
        return sorted(v for v, n in self._counts.items() for _ in range(n))


class IdSet:
    """The unfinished local IDs: a set with its minimum, built for batches.

    IDs are handed out in ascending batches and mostly complete in the same order, so
    adding is an append to a sorted list and completing the oldest batch moves a start
    index: no per-ID work in Python for a 100-ID `get_next_mult`. IDs completed out of
    order are dropped from the list lazily, when they reach its front.
    """

    __slots__ = ("_order", "_start", "live")

    def __init__(self) -> None:
        self.live: set[int] = set()  # read directly on the hot path
        self._order: list[int] = []  # sorted; may hold completed IDs (lazily dropped)
        self._start = 0

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, value: int) -> bool:
        return value in self.live

    def add_all(self, values: list[int]) -> int | None:
        """Add sorted `values`; if one is already here (or repeated), add nothing and
        return it."""
        if not values:
            return None
        live = self.live
        if not live.isdisjoint(values) or len(set(values)) != len(values):
            return first_offender(values, live.__contains__)
        live.update(values)
        order = self._order
        if len(order) == self._start or values[0] > order[-1]:
            order.extend(values)
        else:
            for value in values:
                insort(order, value, lo=self._start)
        return None

    def remove_all(self, values: list[int]) -> int | None:
        """Remove sorted `values`; if one is not here (or repeated), remove nothing and
        return it."""
        if not values:
            return None
        live = self.live
        if not live.issuperset(values) or len(set(values)) != len(values):
            return first_offender(values, lambda value: value not in live)
        live.difference_update(values)
        start, order = self._start, self._order
        if order[start : start + len(values)] == values:  # the oldest ones: the usual case
            self._start = start + len(values)
            self._compact()
        return None

    def min(self) -> int | None:
        order, live, start = self._order, self.live, self._start
        while start < len(order) and order[start] not in live:
            start += 1
        self._start = start
        self._compact()
        return order[self._start] if self._start < len(order) else None

    def sorted(self) -> list[int]:
        return sorted(self.live)

    def _compact(self) -> None:
        if self._start * 2 > len(self._order):
            del self._order[: self._start]
            self._start = 0


def first_offender(values: list[int], bad: Callable[[int], bool]) -> int:
    """The first of `values` that is `bad` or repeats an earlier one (there is one)."""
    seen: set[int] = set()
    for value in values:
        if bad(value) or value in seen:
            return value
        seen.add(value)
    raise AssertionError("no offender among values already found to have one")


class AscendingIds:
    """Completed IDs above persisted-up-to, sorted and distinct, for skipping over
    gapless runs.

    IDs nearly always arrive in ascending order (a writer's own completions, positions
    that only grow), so adding is an append, and skipping is binary search: in sorted
    distinct integers, `ids[k] - k` stays the same along a gapless run and grows after
    a gap. No per-ID work in Python on the write path, unlike a heap.
    """

    __slots__ = ("_ids", "_start")

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._start = 0  # ids[:start] are consumed

    def add(self, value: int) -> None:
        ids = self._ids
        if len(ids) == self._start or value > ids[-1]:
            ids.append(value)
            return
        at = bisect_right(ids, value, lo=self._start)
        if at == self._start or ids[at - 1] != value:
            ids.insert(at, value)

    def add_all(self, values: list[int]) -> None:
        """Add `values`, sorted ascending."""
        if not values:
            return
        ids = self._ids
        if (len(ids) == self._start or values[0] > ids[-1]) and len(set(values)) == len(values):
            ids.extend(values)
        else:
            for value in values:
                self.add(value)

    def skip(self, persisted: int) -> int:
        """The largest p >= `persisted` such that every ID in (persisted, p] is here;
        forgets the IDs at or below p."""
        ids = self._ids
        i = bisect_right(ids, persisted, lo=self._start)
        if i < len(ids) and ids[i] == persisted + 1:
            run = ids[i] - i
            i = bisect_right(Offsets(ids), run, lo=i)
            persisted = ids[i - 1]
        if i * 2 > len(ids):
            del ids[:i]
            i = 0
        self._start = i
        return persisted

    def __len__(self) -> int:
        return len(self._ids) - self._start


class Offsets:
    """`ids[k] - k` as a sequence for bisect: non-decreasing when `ids` is sorted and
    distinct, and constant exactly along a gapless run."""

    __slots__ = ("_ids",)

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, k: int) -> int:
        return self._ids[k] - k
