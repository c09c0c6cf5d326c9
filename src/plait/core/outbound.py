"""What a writer sends about one of its streams: RDATA for rows, POSITION for the rest.
No I/O.

The shell reads its own rows in pages, (sent_upto, current] at a time (the same
`get_updates_since` the readers use), and turns each page into commands here (R-RP-4):
- one RDATA per row; rows sharing a token are tagged `batch` but the last, so a reader
  hands them over together;
- then, when the page reaches past its last row (or holds none), `POSITION last upto`:
  nothing of this writer lies in between, so readers may advance to `upto`.
Reading the range rather than sending what was just written is what makes POSITION
true: every row at or below `upto` went out before it. A reader that connects later
gets `POSITION` (the answer to REPLICATE) and reads older rows itself (R-RP-5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plait.core.commands import Command, Position, Rdata


@dataclass(slots=True)
class Outbound:
    """One stream of this writer: how far everything was sent."""

    stream: str
    instance: str
    sent_upto: int

    def page(self, rows: list[tuple[int, Any]], upto: int) -> list[Command]:
        """Commands for the rows of (sent_upto, upto], sorted by token; nothing when
        `upto` is not past `sent_upto`."""
        if upto <= self.sent_upto:
            return []
        tokens = [token for token, _ in rows]
        if tokens != sorted(tokens) or (
            tokens and (tokens[0] <= self.sent_upto or tokens[-1] > upto)
        ):
            raise ValueError(
                f"{self.stream}: rows must be sorted and within ({self.sent_upto}, {upto}]"
            )
        commands: list[Command] = []
        for i, (token, row) in enumerate(rows):
            last_of_token = i + 1 == len(rows) or rows[i + 1][0] != token
            commands.append(
                Rdata(self.stream, self.instance, token if last_of_token else None, row)
            )
        last = tokens[-1] if tokens else self.sent_upto
        if upto > last:
            commands.append(Position(self.stream, self.instance, last, upto))
        self.sent_upto = upto
        return commands

    def skip(self, upto: int) -> Position:
        """Move on to `upto` without sending the rows in between: `POSITION upto upto`
        claims nothing about them, so every reader behind `upto` reads them itself."""
        if upto > self.sent_upto:
            self.sent_upto = upto
        return Position(self.stream, self.instance, upto, upto)

    def replicate(self) -> Position:
        """The answer to REPLICATE: where this writer stands, with nothing in between."""
        return Position(self.stream, self.instance, self.sent_upto, self.sent_upto)
