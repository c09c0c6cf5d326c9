"""The positions the spec allows each writer over time (SPEC R-ID-3 to R-ID-5), rebuilt
from the writers' journals and the faults, for the checker's judge (`verdict`).

- a writer with IDs unfinished is at its largest completed ID below the smallest, and
  one with a fetch of IDs on its way stays below what the fetch may return (above the
  head when it began);
- a writer idle for a second is at the largest ID taken anywhere a second before (time
  it spent paused by SIGSTOP does not count: it could neither learn nor publish then);
- a dead writer is where a fence may move it: the highest of the other writers'
  positions, or its own last row (so with every writer dead nothing may move until
  one comes back, and a restart registers at the head);
- a writer cut off from PostgreSQL (`pg_partition`) holds what it held, dead or alive,
  until its connections end (the partition's `cut`: the keepalive bound), and what it
  did just before (it publishes through the database): from then on it is dead until
  the partition heals, then alive again where the fence left it, held by its fetches
  still on their way (it goes on, renewed, or exits). A fence needs PostgreSQL: an
  outage moves the cut past it, and a partition that heals before anyone could fence
  the writer leaves it alive where it was;
- the linear position is the least of them.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# A pause this soon after a writer's position moved may have kept the move from being
# published (positions are flushed and announced a fraction of a second later).
PUBLISH_WINDOW = 1.0
# An idle writer learns how far others allocated from replication or the database and
# publishes its advance a little later: it is allowed at the head of this long ago, once
# it has been idle this long.
IDLE_GRACE = 1.0
TICK = 0.1
# After the transport comes back: the checker's reconnect backoff cap (1 s), then an
# announce interval (1 s) before every writer has told its position again.
TRANSPORT_GRACE = 2.0
# After PostgreSQL comes back: pools reconnect with backoff (capped at 2 s for reads),
# and a writer whose connections all died may have been fenced meanwhile and goes on
# as a new incarnation (registered, positions flushed and announced) a moment later.
DATABASE_GRACE = 4.0
# How far a fence of a writer cut off from the database trails the others' positions:
# fences come every fence_after / 10 while it holds, each to the positions the fencing
# process has heard, which trail by up to an announce interval (1 s) and a round trip.
# The cut-off writer heals as a new incarnation at its last fence's position (it does
# not register at the head as a restarted one does), so the judge must not put it
# further than that.
FENCE_LAG = 2.0
# How long after `fence_after` the others need to find a writer whose connections ended
# and fence it: a look at the writers holding them back (every fence_after / 10) and a
# round trip.
FENCE_SCAN = 1.0

Steps = list[tuple[float, int]]  # (time, position), both non-decreasing


@dataclass
class History:
    """What the writers and the fault injector recorded.

    `events[stream]`: (time, writer, kind, IDs) with kind "A" (taken) or "C", "R", "E"
    (settled: committed, rolled back, failed), or "F" and "f" (a fetch began, ended;
    its serial number in place of IDs). `starts` and `deaths` per writer.
    """

    events: dict[str, list[tuple[float, str, str, list[int]]]] = field(default_factory=dict)
    starts: dict[str, list[float]] = field(default_factory=dict)
    deaths: dict[str, list[float]] = field(default_factory=dict)
    stops: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # Per writer: (hole, cut, healed) of each partition of its database connections;
    # cut and healed None when that never happened.
    partitions: dict[str, list[tuple[float, float | None, float | None]]] = field(
        default_factory=dict
    )
    own_positions: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    # When PostgreSQL was down (restarts, crashes): nobody can fence then.
    db_outages: list[tuple[float, float]] = field(default_factory=list)
    fence_after: float = 1.0  # the writers' setting

    def fenceable(self, cut: float, healed: float | None) -> float | None:
        """When a fence may first claim a writer whose connections a partition ended
        at `cut`: then, unless PostgreSQL was down, or had come back less than
        `DATABASE_GRACE` before (the fencers reconnect), before the others had
        `FENCE_SCAN` after `fence_after` of it: then that grace after it came back.
        None when the partition healed before a fence could follow (the latest one
        can: a quick fencer may do it sooner, which is never held against it): the
        writer goes on alive where it was. Seen in a run: cut, a crash 0.8 s later,
        healed 0.5 s after the server came back; the writer's own open transaction
        then held it, rightly."""
        window = self.fence_after + FENCE_SCAN
        at = cut
        for down, up in merged_windows(self.db_outages):
            if down < at + window and up + DATABASE_GRACE > at:
                at = up + DATABASE_GRACE
        if healed is not None and healed < at + window:
            return None
        return at


def allowed_positions(history: History, stream: str, writers: Iterable[str]) -> dict[str, Steps]:
    """Each writer's position on `stream` over time, as the spec allows it."""
    writers = list(writers)
    timeline: list[tuple[float, int, str, str, list[int]]] = []
    for t, w, kind, ids in history.events.get(stream, []):
        timeline.append((t, 1, w, kind, ids))
    for w in writers:
        timeline += [(t, 0, w, "start", []) for t in history.starts.get(w, [])]
        timeline += [(t, 0, w, "death", []) for t in history.deaths.get(w, [])]
        for start, end in history.stops.get(w, []):
            timeline += [(start, 0, w, "pause", []), (end, 0, w, "cont", [])]
        for hole, cut, healed in history.partitions.get(w, []):
            timeline.append((hole, 0, w, "hole", []))
            fence = history.fenceable(cut, healed) if cut is not None else None
            timeline += [(t, 0, w, kind, []) for t, kind in ((fence, "cut"), (healed, "heal")) if t]
    if timeline:  # idle writers move with time, not only at events
        first, last = min(e[0] for e in timeline), max(e[0] for e in timeline)
        ticks = int((last - first + 2 * IDLE_GRACE) / TICK) + 1
        timeline += [(first + k * TICK, 2, "", "tick", []) for k in range(ticks)]
    timeline.sort(key=lambda e: (e[0], e[1]))
    started = dict.fromkeys(writers, False)
    dead = dict.fromkeys(writers, False)
    held = dict.fromkeys(writers, False)  # partitioned, its connections not ended yet
    cut_off = dict.fromkeys(writers, False)  # dead by a partition that cut it, not a kill
    unfinished: dict[str, set[int]] = {w: set() for w in writers}
    waiting: dict[str, list[int]] = {w: [] for w in writers}  # heap of unfinished (lazy)
    completed: dict[str, list[int]] = {w: [] for w in writers}  # heap, above the position
    fetching: dict[str, dict[int, int]] = {w: {} for w in writers}  # serial -> floor
    last_row = dict.fromkeys(writers, 0)
    position = dict.fromkeys(writers, 0)
    idle_since: dict[str, float | None] = dict.fromkeys(writers)
    paused_at: dict[str, float | None] = dict.fromkeys(writers)
    steps: dict[str, Steps] = {w: [] for w in writers}
    head = 0
    head_at: Steps = [(0.0, 0)]
    for t, _, w, kind, ids in timeline:
        if kind == "tick":
            pass
        elif w not in position:
            continue
        elif kind == "pause":
            paused_at[w] = t
        elif kind == "cont":  # idle time counts only while it runs
            since, paused = idle_since[w], paused_at[w]
            if since is not None and paused is not None:
                idle_since[w] = since + (t - max(since, paused))
            paused_at[w] = None
        elif kind == "F":
            fetching[w][ids[0]] = head + 1  # the sequence gives it nothing lower
            idle_since[w] = None
        elif kind == "f":
            fetching[w].pop(ids[0], None)
        elif kind == "hole":
            held[w] = True
        elif kind == "cut":
            held[w] = False
            if started[w] and not dead[w]:  # as a death, but its fetches go on waiting
                dead[w] = cut_off[w] = True
                unfinished[w].clear()
                waiting[w].clear()
                completed[w].clear()
                idle_since[w] = None
        elif kind == "heal":
            held[w] = False
            if cut_off[w]:
                dead[w] = cut_off[w] = False
        elif kind == "A":
            unfinished[w].update(ids)
            for i in ids:
                heapq.heappush(waiting[w], i)
            idle_since[w] = None
            if max(ids) > head:
                head = max(ids)
                head_at.append((t, head))
        elif kind in ("C", "R", "E"):
            unfinished[w].difference_update(ids)
            for i in ids:
                heapq.heappush(completed[w], i)
            if kind == "C":
                last_row[w] = max(last_row[w], *ids)
        else:
            started[w] = True
            dead[w] = kind == "death"
            cut_off[w] = False
            unfinished[w].clear()
            waiting[w].clear()
            completed[w].clear()
            fetching[w].clear()
            idle_since[w] = None
            if kind == "start":  # registers at the head (R-ID-9)
                position[w] = max(position[w], head)
                steps[w].append((t, position[w]))
                idle_since[w] = t
        for v in writers:
            if not started[v]:
                continue
            new = position[v]
            if dead[v] and held[v]:
                pass  # its connections live on behind the partition: no fence yet
            elif dead[v]:  # what a fence may claim: the others' highest, its own last row
                others = (
                    [_at(steps[o], t - FENCE_LAG) for o in writers if o != v]
                    if cut_off[v]
                    else [position[o] for o in writers if o != v]
                )
                new = max(new, last_row[v], *others) if others else max(new, last_row[v])
            else:
                heap = waiting[v]
                while heap and heap[0] not in unfinished[v]:
                    heapq.heappop(heap)
                holds = [*heap[:1], *fetching[v].values()]
                if holds:
                    hold, done = min(holds), completed[v]
                    while done and done[0] < hold:
                        new = max(new, heapq.heappop(done))
                else:  # its own last; the head once idle for IDLE_GRACE (R-ID-5)
                    new = max(new, *completed[v]) if completed[v] else new
                    completed[v].clear()
                    since = idle_since[v]
                    if since is None:
                        idle_since[v] = t
                    elif paused_at[v] is None and t - since >= IDLE_GRACE:
                        i = bisect.bisect_right(head_at, (t - IDLE_GRACE, head)) - 1
                        new = max(new, head_at[i][1])
            if new > position[v]:
                position[v] = new
                steps[v].append((t, new))
    # What a writer could not publish: paused, or cut off from the database (it reads
    # its rows back to send them, and flushes its position there) until its
    # connections end, when a fence may move it.
    unpublished: list[tuple[str, float, float | None]] = [
        (w, start, end) for w, pauses in history.stops.items() for start, end in pauses
    ]
    for w, partitions in history.partitions.items():
        unpublished += [
            (w, hole, (history.fenceable(cut, healed) if cut is not None else None) or healed)
            for hole, cut, healed in partitions
        ]
    for w, since, until in unpublished:
        if w in steps and until is not None:
            steps[w] = [
                (until if since - PUBLISH_WINDOW <= t <= until else t, p) for t, p in steps[w]
            ]
    return steps


def _at(steps: Steps, t: float) -> int:
    """A writer's position at time `t` (0 before its first step)."""
    i = bisect.bisect_right(steps, (t, float("inf"))) - 1
    return steps[i][1] if i >= 0 else 0


def least(per_writer: Mapping[str, Steps]) -> Steps:
    """The linear position over time: the least of the writers' positions."""
    current = dict.fromkeys(per_writer, 0)
    merged = sorted((t, w, p) for w, steps in per_writer.items() for t, p in steps)
    result: Steps = []
    low = 0
    for t, w, p in merged:
        current[w] = max(current[w], p)
        now = min(current.values())
        if now > low:
            low = now
            result.append((t, now))
    return result


def merged_windows(windows: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Time windows, overlaps merged, sorted."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(windows):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
