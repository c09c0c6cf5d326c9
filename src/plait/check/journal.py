"""What the checker's processes record: one line per event, in a file of their own.

A writer's line is written with one `write(2)` before it goes on, so a kill -9 loses at
most the line being formed, never one written earlier (the page cache keeps it). Lines
are plain text, `KIND TIME FIELD...`, because writers log every ID they take and JSON
would cost more than the write it records.

Kinds:
    F t stream serial            a writer asks for IDs (before they are on their way)
    A t stream id,id,... serial  ... they arrived ("-": none, the fetch failed)
    C t stream id,id,...         ... committed them
    R t stream id,id,...         ... rolled them back on purpose
    E t stream id,id,...         ... failed: committed or not, the database says
    P t stream position          a writer's own position, or a reader's linear one
    W t stream writer token      a reader saw `writer` reach `token`
    D t stream writer id,id,...  a reader got these rows of `writer`
    V t what...                  a reader saw something wrong (regression, stale cache)
    S t what...                  a state change (started, idle, caught-up, ...)
    Q t stream {writer: pos}     a process's view of every writer, when it changed
    F t fault target...          (faults.journal only) what the orchestrator did
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


class Kind(StrEnum):
    """The kinds of line above, by name: one letter each in the file (writers log every
    ID they take), a word each in the code."""

    FETCH = "F"
    ARRIVED = "A"
    COMMITTED = "C"
    ROLLED_BACK = "R"
    FAILED = "E"
    POSITION = "P"
    TOKEN = "W"
    DELIVERED = "D"
    VIOLATION = "V"
    STATE = "S"
    VIEW = "Q"
    # faults.journal only, a file of its own: the same letter as FETCH, so an alias of
    # it in Python (`Kind.FAULT is Kind.FETCH`), named for what it means there.
    FAULT = "F"


@dataclass(frozen=True, slots=True)
class Line:
    kind: str
    t: float
    fields: tuple[str, ...]


class Journal:
    """Appends lines to one file, each with a single unbuffered write."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, kind: str, *fields: object) -> None:
        text = " ".join((kind, f"{time.time():.4f}", *map(str, fields)))
        os.write(self._fd, (text + "\n").encode())

    def ids(self, kind: str, stream: str, ids: Iterable[int]) -> None:
        self.write(kind, stream, ",".join(map(str, ids)))

    def close(self) -> None:
        os.close(self._fd)


def read(path: Path) -> Iterator[Line]:
    """The complete lines of a journal (a last line cut by a kill is skipped)."""
    if not path.exists():
        return
    with path.open() as f:
        for text in f:
            if not text.endswith("\n"):
                return
            parts = text.split()
            if len(parts) < 2:
                continue
            yield Line(parts[0], float(parts[1]), tuple(parts[2:]))


def id_list(field: str) -> list[int]:
    """IDs written by `Journal.ids`; "-" is none."""
    return [int(x) for x in field.split(",") if x and x != "-"]
