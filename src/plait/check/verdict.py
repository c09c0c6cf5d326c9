"""Judging a checker run: pure functions of what was committed and what was seen.

Each reader is judged against the positions the spec allows over time (`allowed`).

A reader's *stall* on a committed ID is the time from the allowed position passing
it to the reader's passing it, less the time the transport was down (a Redis restart,
with `TRANSPORT_GRACE` to reconnect) for readers that follow replication: they cannot
hear of a write then, and plait does not claim they can; and the time PostgreSQL was
down (a restart or a crash, with `DATABASE_GRACE` to reconnect) for every reader: no
one can commit or read then. Rows are never excused: a row lost or repeated across an
outage is a violation like any other. So a slow commit (a live
writer's open transaction) holds the IDs above it without counting as a stall, while
a dead writer that is never fenced does. A writer paused with SIGSTOP is live but not
progressing: what it would have published just before or during the pause counts from
the moment it runs again.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from plait.check.allowed import (
    DATABASE_GRACE,
    TRANSPORT_GRACE,
    History,
    Steps,
    least,
    merged_windows,
)


@dataclass
class ReaderLog:
    """What one reader journalled: rows per (stream, writer) and when each token was
    first reached (writer "*" for a linear position)."""

    rows: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    tokens: dict[tuple[str, str], Steps] = field(default_factory=dict)
    # Per stream: (time, each writer's position) as the reader saw them, when they
    # changed (at most once a second): who held a stall back.
    views: dict[str, list[tuple[float, dict[str, int]]]] = field(default_factory=dict)
    violations: Counter[str] = field(default_factory=Counter)
    caught_up: bool = False


@dataclass
class ReaderVerdict:
    name: str
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    phantom: int = 0  # delivered but never committed (rolled back, failed, or made up)
    regressions: int = 0
    stale: int = 0
    replays: int = 0  # batches read again (Spark) with other rows than the first time
    longest_stall: float = 0.0
    stall_at: str = ""
    held_by: str = ""  # the writers below the stalled ID in the reader's view, if known
    # When the longest stall began and ended (time.time(); linear readers only, else 0).
    stall_span: tuple[float, float] = (0.0, 0.0)
    caught_up: bool = True
    examples: list[str] = field(default_factory=list)
    # Whether the stall bound applies: to linear positions. A per-writer token of a
    # dead writer that does not hold the linear position waits for its restart (only
    # the holder is fenced), so its stall is reported, not bounded.
    bounded: bool = True
    # Why the reader stopped reading before the end (its last error), when it did.
    died: str = ""

    def past(self, bound: float) -> bool:
        """Whether its longest stall breaks `bound` (a bounded reader's only)."""
        return self.bounded and self.longest_stall > bound

    def violations(self, bound: float) -> list[str]:
        """Everything that fails the reader at this stall bound."""
        stall = self.stall(bound)
        return [*self.findings(), *([stall] if stall else [])]

    def stall(self, bound: float) -> str | None:
        """Its longest stall, said, when it breaks `bound`."""
        if not self.past(bound):
            return None
        held = f" ({self.held_by})" if self.held_by else ""
        return f"stall {self.longest_stall:.2f} s > {bound:g} s at {self.stall_at}{held}"

    def findings(self) -> list[str]:
        """What fails the reader whatever the stall bound."""
        found = [
            f"{what}: {n}"
            for what, n in (
                ("lost", self.lost),
                ("duplicated", self.duplicated),
                ("phantom", self.phantom),
                ("regressions", self.regressions),
                ("stale", self.stale),
                ("batches replayed with other rows", self.replays),
            )
            if n
        ]
        if self.died:  # next to the losses it explains
            found.append(f"stopped reading: {self.died}")
        if not self.caught_up:
            found.append("did not catch up")
        return found


def excused_windows(
    outages: Iterable[tuple[float, float]], db_outages: Iterable[tuple[float, float]] = ()
) -> list[tuple[float, float]]:
    """Transport and PostgreSQL outages, each with its grace to reconnect, merged and
    sorted."""
    return merged_windows(
        [
            *((a, b + TRANSPORT_GRACE) for a, b in outages),
            *((a, b + DATABASE_GRACE) for a, b in db_outages),
        ]
    )


def _excused(windows: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in windows)


def longest_stall(
    allowed: Steps,
    reached: Steps,
    ids: Iterable[int],
    excused: list[tuple[float, float]] | None = None,
) -> tuple[float, int]:
    """The longest wait, over `ids`, between `allowed` passing an ID and `reached`
    passing it, less any `excused` time in between (`excused_windows`): (seconds, ID).
    An ID never reached counts elsewhere (as lost)."""
    windows = excused or []
    allowed_at = [t for t, _ in allowed]
    allowed_pos = list(itertools.accumulate((p for _, p in allowed), max))
    reached_at = [t for t, _ in reached]
    reached_pos = list(itertools.accumulate((p for _, p in reached), max))
    worst, worst_id = 0.0, 0
    for x in ids:
        i = bisect.bisect_left(reached_pos, x)
        if i == len(reached_pos):
            continue
        j = bisect.bisect_left(allowed_pos, x)
        ready = allowed_at[j] if j < len(allowed_pos) else reached_at[i]
        wait = reached_at[i] - ready
        if wait > worst and windows:
            wait -= _excused(windows, ready, reached_at[i])
        if wait > worst:
            worst, worst_id = wait, x
    return worst, worst_id


def stall_window(allowed: Steps, reached: Steps, x: int) -> tuple[float, float]:
    """When `allowed` passed ID `x` and when `reached` did (both present)."""
    ready = next((t for t, p in allowed if p >= x), math.inf)
    done = next((t for t, p in reached if p >= x), math.inf)
    return min(ready, done), done


def held_by(views: list[tuple[float, dict[str, int]]], x: int, start: float, end: float) -> str:
    """Who held a reader below ID `x` from `start` to `end`, by its views of the
    writers' positions then (the last one before `start` on): each writer below `x`
    in the most of them, with the position it stayed at. "" with no views."""
    i = max(0, bisect.bisect_right(views, start, key=lambda v: v[0]) - 1)
    seen = [view for t, view in views[i:] if t < end]
    below: Counter[str] = Counter(w for view in seen for w, p in view.items() if p < x)
    if not below:
        return ""
    most = max(below.values())
    names = sorted(w for w, n in below.items() if n == most)
    lowest = {w: min(view[w] for view in seen if view.get(w, x) < x) for w in names}
    return "held back by " + ", ".join(f"{w} at {lowest[w]}" for w in names)


def judge_reader(
    name: str,
    log: ReaderLog,
    committed: Mapping[str, Mapping[int, str]],
    allowed: Mapping[str, Mapping[str, Steps]] | None,
    *,
    per_writer: bool,
    outages: Iterable[tuple[float, float]] = (),
    db_outages: Iterable[tuple[float, float]] = (),
    died: str = "",
) -> ReaderVerdict:
    """Exactly once, nothing uncommitted, no regression, and how long it stalled.

    `committed[stream]` maps each committed ID to its writer; a reader journals rows
    under their writer (per-writer readers) or under "*". `allowed[stream][writer]` are
    the writers' allowed positions (None: no stall check). `outages` are the times the
    transport was down, for a reader that depends on it; `db_outages` the times
    PostgreSQL was down. Both excuse stalls only. `died` is why the reader stopped
    reading, if it did.
    """
    excused = excused_windows(outages, db_outages)
    verdict = ReaderVerdict(name, caught_up=log.caught_up, bounded=not per_writer, died=died)
    verdict.regressions = log.violations["regression"] + log.violations["order"]
    verdict.stale = log.violations["stale"]
    verdict.replays = log.violations["replay"]
    counts: dict[str, Counter[int]] = defaultdict(Counter)
    for (stream, writer), ids in log.rows.items():
        expected = committed.get(stream, {})
        for i in ids:
            counts[stream][i] += 1
            owner = expected.get(i)
            if owner is None or (writer != "*" and owner != writer):
                verdict.phantom += 1
                _example(verdict, f"phantom {stream}:{i} from {writer}")
    for stream, expected in committed.items():
        got = counts.get(stream, Counter())
        verdict.delivered += sum(got.values())
        for i in sorted(expected):  # the examples are then the lowest IDs
            n = got.get(i, 0)
            if n == 0:
                verdict.lost += 1
                _example(verdict, f"lost {stream}:{i}")
            elif n > 1:
                verdict.duplicated += n - 1
                _example(verdict, f"duplicated {stream}:{i} x{n}")
    if allowed is None:
        return verdict
    for stream, expected in committed.items():
        writers = allowed.get(stream, {})
        if per_writer:
            by_writer: dict[str, list[int]] = defaultdict(list)
            for i, w in sorted(expected.items()):
                by_writer[w].append(i)
            cases = [
                (w, writers.get(w, []), log.tokens.get((stream, w), []), ids)
                for w, ids in by_writer.items()
            ]
        else:
            cases = [("", least(writers), log.tokens.get((stream, "*"), []), sorted(expected))]
        for w, steps, reached, ids in cases:
            stall, at = longest_stall(steps, reached, ids, excused)
            if stall > verdict.longest_stall:
                where = f"{stream}:{at}" + (f" ({w})" if w else "")
                verdict.longest_stall, verdict.stall_at = stall, where
                if not per_writer:
                    start, end = stall_window(steps, reached, at)
                    verdict.stall_span = (start, end)
                    verdict.held_by = held_by(log.views.get(stream, []), at, start, end)
    return verdict


def own_regressions(history: History) -> list[str]:
    """Writers whose own position ever went backwards, across restarts too."""
    found = []
    for (writer, stream), positions in history.own_positions.items():
        for before, after in itertools.pairwise(positions):
            if after < before:
                found.append(f"{writer} on {stream}: {before} -> {after}")
    return found


def _example(verdict: ReaderVerdict, text: str) -> None:
    if len(verdict.examples) < 5:
        verdict.examples.append(text)
