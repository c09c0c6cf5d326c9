"""Each writer's row in `stream_positions`, as registrations and fences change it:
both take the row's lock, prove the run that holds the row gone (no server process
carries its epoch's name) and only then move the row. A run registers before its first
allocation, so a fence never claims its IDs (R-ID-14); a fenced run may open no new
connection (`storage/incarnation.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import AsyncConnection, sql
from psycopg.rows import TupleRow

from plait.core.spec import StreamSpec
from plait.storage.database import Database
from plait.storage.incarnation import name_prefix
from plait.storage.recorded import head_of
from plait.storage.stream_tables import StreamTable
from plait.storage.transaction import Transaction

# Longest a transaction holding a writer's row lock (a fence, a registration) may sit
# idle before the server ends it. The holder runs a few short statements back to back;
# one stalled in between (SIGSTOP, a partition: the server sees a live socket) kept the
# row locked for the session-wide idle_in_transaction_session_timeout (60 s), and the
# writer's own position stores and every other fence of it waited that long.
ROW_LOCK_IDLE_LIMIT = "2s"


@dataclass(frozen=True, slots=True)
class PreviousRun:
    """The run of an instance registered on a stream before, still connected: its
    epoch and how many server processes carry its name."""

    epoch: int
    alive: int


@dataclass(frozen=True, slots=True)
class Registered:
    """A writer's registration went through. `taken`: an ID it took from the sequence
    and gave back unused (internal), to start at or above everything its previous runs
    may have reported (`WriterRows.register`); its registered position then."""

    taken: int | None


@dataclass(frozen=True, slots=True)
class FenceResult:
    """What `WriterRows.fence` found: the writer's registered epoch (None: it has none
    and is never fenced), how many of its connections are alive (then nothing moved),
    and its position after the fence (internal) when it was fenced."""

    epoch: int | None
    alive: int
    position: int | None


class WriterRows:
    """Registrations and fences of one stream's writers (`StreamStore.writers`); values
    in the internal domain."""

    def __init__(
        self,
        db: Database,
        spec: StreamSpec,
        tables: list[StreamTable],
        head_query: sql.Composed,
        allocate_in: Callable[[Transaction, int], Awaitable[list[int]]],
    ) -> None:
        self._db = db
        self._spec = spec
        self._sign = spec.sign
        self._tables = tables
        self._head_query = head_query
        self._allocate_in = allocate_in

    async def register(self, instance: str, position: int) -> PreviousRun | Registered:
        """This writer's row before its first allocation: its position (forwards only)
        and the epoch its connections carry (none when the pool carries no incarnation
        of `instance`: it can then never be fenced). A fence of an earlier run no longer
        applies. Durable, and it waits for a fence in progress on the row (which then
        finds this run's connections).

        Not while the previous run registered on the row still has server processes
        (its name): nothing is changed then, and that run is returned. It may still
        commit IDs below rows it committed, which start-up takes as final. Once this
        run is registered, the previous one cannot connect again (`SupersededError`),
        under the same row lock as a fence.

        When `position` is below the sequence head, this run takes one ID and registers
        at it, unused (R-ID-14): a previous run may have reported a position up to the
        head that neither rows nor stored positions show any more (an ID it rolled
        back, or the idle rule's, stored with asynchronous commit and lost in a crash
        that killed it too). Its own IDs are all finished, so an ID above the head is a
        position it may claim; the head itself may be another writer's, in flight."""
        keep = ">" if self._spec.backwards else "<"
        async with self._row_transaction() as txn:
            # The epoch read with a connection handed out (the transaction holds it): one
            # that found this run fenced renewed it first, and the row must carry the
            # name its connections carry from now on, not the one of a moment ago.
            incarnation = self._db.incarnation
            current = (
                incarnation.epoch
                if incarnation is not None and incarnation.instance == instance
                else None
            )
            row = await self._locked_row(txn, instance)
            previous = None if row is None or row[1] is None else int(row[1])
            if previous is not None and previous != current:
                alive = await _connections_of(txn, previous)
                if alive:
                    return PreviousRun(previous, alive)
            head_row = await (await txn.execute(self._head_query)).fetchone()
            assert head_row is not None
            taken = None
            if position < head_of(head_row):
                taken = position = (await self._allocate_in(txn, 1))[0]
            await txn.execute(
                "INSERT INTO stream_positions (stream_name, instance_name, stream_id, epoch)"
                " VALUES (%s, %s, %s, %s)"
                " ON CONFLICT (stream_name, instance_name) DO UPDATE SET"
                f" stream_id = CASE WHEN stream_positions.stream_id {keep} EXCLUDED.stream_id"
                " THEN EXCLUDED.stream_id ELSE stream_positions.stream_id END,"
                " epoch = EXCLUDED.epoch, fenced_at = NULL, updated_at = now()",
                (self._spec.name, instance, self._sign * position, current),
            )
        if current is not None:
            self._db.registered(self._spec.name)
        return Registered(taken)

    async def connections_of(self, epoch: int) -> int:
        """How many server processes carry that epoch's name (no lock taken)."""
        async with self._db.connection() as conn:
            return await _connections_of(conn, epoch)

    @contextlib.asynccontextmanager
    async def _row_transaction(self) -> AsyncIterator[Transaction]:
        """A transaction for `_locked_row`. The server ending it for idling past
        `ROW_LOCK_IDLE_LIMIT` (this process stalled) is a lost connection: nothing was
        committed, and the step may be tried again (`Database.retry_idempotent`)."""
        try:
            async with self._db.transaction() as txn:
                yield txn
        except psycopg.errors.IdleInTransactionSessionTimeout as err:
            raise psycopg.OperationalError(
                f"the server ended a transaction holding a row of stream_positions: {err}"
            ) from err

    async def _locked_row(self, txn: Transaction, instance: str) -> tuple[Any, ...] | None:
        """`instance`'s (stream_id, epoch) in `stream_positions`, locked until the end of
        `txn` (from `_row_transaction`): fences and registrations of one row take turns,
        and none holds it idle longer than `ROW_LOCK_IDLE_LIMIT`."""
        # Its own statement: sent with the SELECT, in one pipeline, it was not applied.
        await txn.execute(
            f"SET LOCAL idle_in_transaction_session_timeout = '{ROW_LOCK_IDLE_LIMIT}'"
        )
        return await (
            await txn.execute(
                "SELECT stream_id, epoch FROM stream_positions"
                " WHERE stream_name = %s AND instance_name = %s FOR UPDATE",
                (self._spec.name, instance),
            )
        ).fetchone()

    async def fence(self, writer: str, target: int) -> FenceResult:
        """Move a dead writer's position up to `target` (internal; a completed ID, such
        as another writer's position), in one transaction that proves it dead first.

        Under the row's lock: its registered epoch, then whether any server process
        still carries that epoch's name (none: everything the run did is committed or
        rolled back, and it may open no new connection once fenced), then the sequence
        head S. The row moves to min(target, S), or to the writer's last row at or
        below S when that is higher, never backwards, and is stamped fenced. Only
        completed IDs, never S itself: S may be another writer's ID still in flight,
        and a position is a promise that it completed. A later run registers a new
        epoch under the same lock, before it allocates, so a fence never claims its
        IDs."""
        async with self._row_transaction() as txn:
            row = await self._locked_row(txn, writer)
            if row is None or row[1] is None:
                return FenceResult(None, 0, None)
            current, epoch = self._sign * int(row[0]), int(row[1])
            alive = await _connections_of(txn, epoch)
            if alive:
                return FenceResult(epoch, alive, None)
            head_row = await (await txn.execute(self._head_query)).fetchone()
            assert head_row is not None
            head = head_of(head_row)
            # Its own rows up to S are committed, so completed IDs too: the last of them
            # may pass `target` (when every writer died, nobody else is ahead).
            own_max = current
            for table in self._tables:
                found = await (
                    await txn.execute(
                        table.own_max_above_query(sql.Literal(table.stored(current))),
                        {"inst": writer},
                    )
                ).fetchone()
                if found is not None and found[0] is not None:
                    last = self._sign * int(found[0])
                    if last <= head:
                        own_max = max(own_max, last)
            moved = max(current, min(target, head), own_max)
            await txn.execute(
                "UPDATE stream_positions SET stream_id = %s, updated_at = now(),"
                " fenced_at = COALESCE(fenced_at, now())"
                " WHERE stream_name = %s AND instance_name = %s",
                (self._sign * moved, self._spec.name, writer),
            )
        return FenceResult(epoch, 0, moved)


async def _connections_of(txn: Transaction | AsyncConnection[TupleRow], epoch: int) -> int:
    """How many server processes carry that epoch's name: none, and everything its run
    did is committed or rolled back (the proof behind fences and registrations)."""
    row = await (
        await txn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE starts_with(application_name, %s)",
            (name_prefix(epoch),),
        )
    ).fetchone()
    return int(row[0]) if row else 0
