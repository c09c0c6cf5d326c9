"""What a checker reader got, journalled in batches (readers are never killed)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from plait.check.journal import Journal, Kind


class Seen:
    """Rows per (stream, writer) and tokens; an ID out of order or a token going back
    is journalled as a violation where it happens, for the judge to count."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self._rows: dict[tuple[str, str], list[int]] = defaultdict(list)
        self._last_id: dict[tuple[str, str], int] = {}
        self.tokens: dict[tuple[str, str], int] = {}
        self._journalled_tokens: dict[tuple[str, str], int] = {}

    def rows(self, stream: str, writer: str, ids: Iterable[int]) -> None:
        key = (stream, writer)
        batch = self._rows[key]
        last = self._last_id.get(key, 0)
        for i in ids:
            if writer != "*" and i <= last:
                self.journal.write(Kind.VIOLATION, "order", stream, writer, f"{i}<={last}")
            last = i
            batch.append(i)
        self._last_id[key] = last

    def token(self, stream: str, writer: str, token: int) -> None:
        key = (stream, writer)
        before = self.tokens.get(key)
        if before is not None and token < before:
            self.journal.write(Kind.VIOLATION, "regression", stream, writer, f"{token}<{before}")
            return
        self.tokens[key] = token

    def flush(self) -> None:
        for (stream, writer), ids in self._rows.items():
            if ids:
                self.journal.write(Kind.DELIVERED, stream, writer, ",".join(map(str, ids)))
                ids.clear()
        for key, token in self.tokens.items():
            if self._journalled_tokens.get(key) != token:
                self.journal.write(Kind.TOKEN, *key, token)
                self._journalled_tokens[key] = token

    def reached(self, targets: dict[str, dict[str, int]]) -> bool:
        return all(
            self.tokens.get((stream, writer), 0) >= target
            for stream, per_writer in targets.items()
            for writer, target in per_writer.items()
        )
