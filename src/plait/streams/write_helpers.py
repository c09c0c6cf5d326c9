"""What every write goes through besides the generator itself: a `get_next` block's IDs
(`Reservation`), a statement sent with COMMIT (`InsertAtCommit`), and the record of the
generator's parts they use (`Parts`), handed over once."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import psycopg
from psycopg.rows import TupleRow

from plait.core.positions import FetchTicket, SequenceWentBackwardsError
from plait.errors import (
    ConfigError,
)
from plait.storage.transaction import Params, WalProgress
from plait.streams.allocator import Fetches, IdAllocator
from plait.streams.shared import Shared

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Parts:
    """What the per-write helpers below use of their generator."""

    shared: Shared
    allocator: IdAllocator
    wal: WalProgress
    fetches: Fetches
    finish_durable: Callable[[list[int], int], Awaitable[None]]
    finish_flushed: Callable[[list[int]], None]
    returned_ids: Callable[[list[Any] | None], list[int]]
    lost: Callable[[FetchTicket], None]
    written: Callable[[list[int], list[str] | None, list[TupleRow] | None], None]


class Reservation(Generic[T]):
    """`get_next()` / `get_next_mult(n)`: IDs for the block, completed when it exits,
    also on error or cancellation. A class rather than a generator-based context
    manager: it runs on every write."""

    __slots__ = ("_ids", "_lsn", "_n", "_parts", "_present")

    def __init__(self, parts: Parts, n: int, present: Callable[[list[int]], T]) -> None:
        self._parts = parts
        self._n = n
        self._present = present
        self._ids: list[int] = []
        self._lsn = 0

    async def __aenter__(self) -> T:
        parts = self._parts
        self._ids = await parts.allocator.allocate(self._n)
        self._lsn = parts.shared.store.allocated_lsn
        parts.wal.watchers += 1  # commits meanwhile tell `Finisher.finish_durable`
        return self._present(self._ids)

    async def __aexit__(self, *exc: object) -> None:
        parts = self._parts
        parts.wal.watchers -= 1
        if exc[0] is None:
            await parts.finish_durable(self._ids, self._lsn)
        else:  # the block failed: no row, most likely
            parts.finish_flushed(self._ids)


class InsertAtCommit:
    """`insert_with_commit`: the statement's IDs are on their way (a fetch ticket holds
    the position) from the moment it is sent until COMMIT answered."""

    __slots__ = ("_before", "_params", "_parts", "_text", "_ticket")

    def __init__(self, parts: Parts, text: str, params: Callable[[], Params] | None) -> None:
        self._parts = parts
        self._text = text
        self._params = params
        self._ticket: FetchTicket | None = None
        self._before = 0

    def statement(self) -> tuple[str, Params]:
        return self._text, None if self._params is None else self._params()

    def sending(self) -> None:
        self._before = self._parts.shared.tracker.local_position
        self._ticket = self._parts.fetches.begin()

    def committed(self, columns: list[str] | None, records: list[TupleRow] | None) -> None:
        parts, ticket = self._parts, self._ticket
        if ticket is None:
            return
        self._ticket = None
        try:
            ids = parts.returned_ids(None if records is None else [r[0] for r in records])
        except IdsNotReturned as err:
            # Committed, but plait cannot tell which IDs it took: as for a lost answer.
            logger.error("stream %s: %s", parts.shared.name, err)
            parts.lost(ticket)
            return
        if ids:
            parts.written(ids, columns, records)
        try:
            parts.fetches.end(ticket, ids, completed=True)
        except SequenceWentBackwardsError as err:
            logger.error("stream %s: %s", parts.shared.name, err)
        parts.shared.poke_if_moved(self._before)

    def failed(self) -> None:
        # The transaction waited until its COMMIT's outcome was final; which IDs the
        # statement took, if it committed, is lost with the answer.
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            self._parts.lost(ticket)


class IdsNotReturned(ConfigError):
    """A statement ran (and may have committed) without returning its IDs as its first
    column: the statement is wrong, and which IDs it took is unknown."""


# A statement that failed with these may have committed all the same: its connection
# broke, it was cancelled, or it committed without returning its IDs.
IDS_UNKNOWN = (psycopg.OperationalError, asyncio.CancelledError, IdsNotReturned)


def column_names(cursor: Any) -> list[str] | None:
    """The column names of a cursor's result, None when it returned no rows."""
    description = cursor.description
    return None if description is None else [column.name for column in description]


def check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"expected a positive number of IDs or rows, not {n!r}")
