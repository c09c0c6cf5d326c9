"""What tracking the age of the oldest unfinished ID costs a write (R-OP-2).

Every allocation path now goes through `streams.allocator.Fetches`, which stamps each
fetch with `time.monotonic()` and hands its IDs to a `PendingAges`. This measures the
client CPU of the position bookkeeping of one write, in-process and without a database
(where the difference would drown in noise): begin/end of a fetch and the completion,
through `Fetches` and straight on the tracker, for a single ID and for a 100-ID batch,
alternating the variants, median of the repetitions.
The figure is the ratio with / without, plus the absolute difference in microseconds.

Run: python bench/pending_ages.py [--reps 9] [--writes 100000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from common import add_smoke_arg, emit, log, median, parse, rnd
from plait.core.positions import PositionTracker
from plait.streams.allocator import Fetches


def bookkeeping(batch: int, ages: bool) -> Callable[[int], float]:
    """A loop of `n` writes of `batch` IDs each: seconds per write. With `ages`, the
    fetch goes through `Fetches` (what every allocation path does); without, straight to
    the tracker (what they did before)."""

    def run(n: int) -> float:
        tracker = PositionTracker("w", writers=["w", "x"], floor=1)
        fetches = Fetches(tracker)
        next_id = 2
        started = time.perf_counter()
        for _ in range(n):
            ids = list(range(next_id, next_id + batch))
            next_id += batch
            if ages:
                ticket = fetches.begin()
                fetches.end(ticket, ids)
            else:
                ticket = tracker.begin_fetch()
                tracker.end_fetch(ticket, ids)
            tracker.complete(ids)
        return (time.perf_counter() - started) / n

    return run


# --smoke: the smallest sizes that still go through every step.
SMOKE = ["--reps", "1", "--writes", "1000"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_smoke_arg(parser)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--writes", type=int, default=100_000)
    args = parse(parser, SMOKE)
    for batch in (1, 100):
        n = args.writes if batch == 1 else args.writes // 10
        samples: dict[bool, list[float]] = {False: [], True: []}
        for rep in range(args.reps):
            for ages in (False, True) if rep % 2 == 0 else (True, False):
                samples[ages].append(bookkeeping(batch, ages)(n))
        without, with_ages = median(samples[False]), median(samples[True])
        log(f"batch {batch}: {without * 1e6:.2f} µs without, {with_ages * 1e6:.2f} µs with")
        emit(
            {
                "bench": "pending_ages_bookkeeping",
                "ids_per_write": batch,
                "without_us_per_write": rnd(without * 1e6, 3),
                "with_us_per_write": rnd(with_ages * 1e6, 3),
                "added_us_per_write": rnd((with_ages - without) * 1e6, 3),
                "ratio": rnd(with_ages / without),
                "reps": args.reps,
                "writes": n,
            }
        )


if __name__ == "__main__":
    main()
