"""When to try fencing a writer that holds a stream's linear position. Pure: the caller
passes the positions it knows and the time, and runs the fence (a database transaction
that only succeeds when none of that writer's connections is alive).

A writer *holds* the stream while its position is the lowest and another writer is
ahead, or, when all are level, while the sequence has handed out IDs above them: a live
idle writer moves up to every ID it sees completed, so IDs above all of them are in
flight, or were taken by a writer that died (its last rows may be committed and not yet
announced). The caller reads the sequence head only when asked (`needs_head`): when all
are level and have kept still for `fence_after`.

A holder becomes a candidate once it has held, without moving, for `fence_after`
seconds: a live idle writer follows the others within an announce interval, so only a
dead writer or one with a transaction open gets there, and the fence tells those two
apart. A failed attempt (the writer was alive) waits `fence_after` before the next one;
a writer fenced once is dead for good (a fenced run can open no connection), so while
it keeps holding it is fenced again after only `fence_after / 10`, and readers follow
the others with about that lag instead of stalling. Of several holders due, the one
tried least recently goes first, so each gets its turn.

A fence that moved nothing is not repeated until some position moves: its writer is
dead, so only another writer's move (or a fence of another holder) can give it
somewhere to go. Without this rule, a reader whose writers had all died fenced each of
them ten times a second, forever (a row lock and a scan of the server's processes
each), and read the sequence head as often.
"""

from __future__ import annotations

from collections.abc import Mapping

QUICK_SHARE = 0.1


class HoldWatch:
    __slots__ = (
        "_ahead_since",
        "_fence_after",
        "_fenced",
        "_futile",
        "_head_asked",
        "_last",
        "_moved_at",
        "_own",
        "_tried",
    )

    def __init__(self, fence_after: float, own: str | None = None) -> None:
        if fence_after <= 0:
            raise ValueError("fence_after must be positive (seconds)")
        self._fence_after = fence_after
        self._own = own  # never a candidate: this process is alive
        self._last: dict[str, int] = {}
        self._moved_at: dict[str, float] = {}
        self._ahead_since: dict[str, float] = {}
        self._tried: dict[str, float] = {}
        self._fenced: set[str] = set()
        # Writers whose last fence moved nothing, with the positions it saw then.
        self._futile: dict[str, dict[str, int]] = {}
        self._head_asked = float("-inf")

    def needs_head(self, positions: Mapping[str, int], now: float) -> bool:
        """Whether `candidate` wants the sequence head now: every writer level, still
        for a while, and the head not asked for that long."""
        self._note(positions, now)
        others = [w for w in positions if w != self._own and not self._is_futile(w)]
        if not others or min(positions.values()) != max(positions.values()):
            return False
        wait = min(self._wait(w) for w in others)
        quiet = now - max(self._moved_at[w] for w in positions)
        if quiet < wait or now - self._head_asked < wait:
            return False
        self._head_asked = now
        return True

    def candidate(
        self, positions: Mapping[str, int], now: float, head: int | None = None
    ) -> str | None:
        """The writer to try fencing now, if any, given every writer's position (and
        the sequence head, when `needs_head` asked for it)."""
        if not positions:
            return None
        self._note(positions, now)
        top = max(positions.values())
        low = min(positions.values())
        if head is not None and head > top == low:
            for writer in positions:  # held since it last moved, as far as we know
                self._ahead_since.setdefault(writer, self._moved_at[writer])
            top = head
        else:
            for writer, position in positions.items():
                if position < top:
                    self._ahead_since.setdefault(writer, now)
                else:
                    self._ahead_since.pop(writer, None)
        holders = [
            w
            for w, p in positions.items()
            if p == low < top and w != self._own and not self._is_futile(w)
        ]
        for writer in sorted(holders, key=self._turn):
            wait = self._wait(writer)
            if (
                now - self._held_since(writer) >= wait
                and now - self._tried.get(writer, float("-inf")) >= wait
            ):
                return writer
        return None

    def tried(self, writer: str, now: float, *, fenced: bool, moved: bool = True) -> None:
        """An attempt on `writer` ended: fenced (and whether that `moved` its
        position), or found alive (or failed)."""
        self._tried[writer] = now
        if fenced:
            self._fenced.add(writer)
        else:
            self._fenced.discard(writer)
        if fenced and not moved:
            self._futile[writer] = dict(self._last)
        else:
            self._futile.pop(writer, None)

    def _is_futile(self, writer: str) -> bool:
        """Its last fence moved nothing, and no position has moved since."""
        seen = self._futile.get(writer)
        if seen is None:
            return False
        if seen == self._last:
            return True
        del self._futile[writer]
        return False

    def is_fenced(self, writer: str) -> bool:
        return writer in self._fenced

    def _note(self, positions: Mapping[str, int], now: float) -> None:
        for writer, position in positions.items():
            if self._last.get(writer) != position:
                self._last[writer] = position
                self._moved_at[writer] = now

    def _turn(self, writer: str) -> tuple[float, float]:
        """Holders go least recently tried first, then longest held: one fenced again
        and again without moving (level with the others) must not keep another holder
        from its turn."""
        return (self._tried.get(writer, float("-inf")), self._held_since(writer))

    def _held_since(self, writer: str) -> float:
        return max(self._moved_at[writer], self._ahead_since[writer])

    def _wait(self, writer: str) -> float:
        share = QUICK_SHARE if writer in self._fenced else 1.0
        return self._fence_after * share
