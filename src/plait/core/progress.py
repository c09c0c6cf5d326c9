"""Progress lines for long work over a range of stream IDs (R-OP-3). Pure: the caller
passes the time and logs the lines.

Quick work says nothing: the first line comes once the work has run `after` seconds,
then one every `every` seconds, and a last one when it ends, only if any was said, so
a log shows long catch-ups from start to end and no noise from the many short ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Progress:
    what: str  # e.g. "catching up events/w1"
    low: int  # the work covers IDs in (low, high]
    high: int
    started: float
    after: float = 2.0
    every: float = 5.0
    rows: int = 0
    at: int = 0
    _said: float | None = None

    def __post_init__(self) -> None:
        self.at = self.low

    def step(self, at: int, rows: int, now: float) -> str | None:
        """The work reached ID `at` with `rows` more rows; a line when one is due."""
        self.at = max(self.at, at)
        self.rows += rows
        due = self.started + self.after if self._said is None else self._said + self.every
        if now < due:
            return None
        self._said = now
        span = self.high - self.low
        share = 100.0 if span <= 0 else 100.0 * (self.at - self.low) / span
        return (
            f"{self.what}: {share:.0f}% of IDs ({self.at - self.low} of {span}), "
            f"{self.rows} rows, {now - self.started:.1f} s"
        )

    def done(self, now: float) -> str | None:
        """The closing line, when the work said anything on the way."""
        if self._said is None:
            return None
        return f"{self.what}: done, {self.rows} rows in {now - self.started:.1f} s"
