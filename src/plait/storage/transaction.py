"""A transaction on one connection, with after-commit hooks and statements that travel
with COMMIT."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import psycopg
from psycopg import AsyncConnection, AsyncCursor
from psycopg.rows import TupleRow

from plait.errors import (
    StateError,
)
from plait.storage.identity import server_pid
from plait.tasks import to_the_end

logger = logging.getLogger(__name__)

Params = Sequence[Any] | Mapping[str, Any] | None


class CommitStatement(Protocol):
    """A statement sent in the same round trip as a transaction's COMMIT
    (`Transaction.send_with_commit`), so writing it costs no round trip of its own."""

    def statement(self) -> tuple[str, Params]:
        """The statement and its parameters, built when COMMIT is sent."""
        ...

    def sending(self) -> None:
        """Called just before the statement leaves, after `statement()`."""
        ...

    def committed(self, columns: list[str] | None, records: list[TupleRow] | None) -> None:
        """COMMIT succeeded: the statement's column names and rows (None when it
        returned none). Runs with the transaction's other after-commit callbacks, after
        them."""
        ...

    def failed(self) -> None:
        """The transaction ended without committing this statement, or how it ended is
        unknown and the server has finished it since (also called when the statement
        was never sent)."""
        ...


@dataclass(slots=True)
class WalProgress:
    """How far PostgreSQL's WAL is known to be on disk (an LSN in bytes), and how many
    `get_next` blocks want to know (R-ID-14): commits then read it (`Transaction`)."""

    flushed: int = 0
    watchers: int = 0


# Waits until the server finished a transaction whose COMMIT lost its answer
# (`Database.wait_finished`).
WaitFinished = Callable[..., Awaitable[None]]


class Transaction:
    """An open transaction on one pooled connection.

    BEGIN is not sent on its own: it travels with the first statement (in the same simple
    query when that has no parameters, else in psycopg's pipeline mode), so a
    transaction costs one round trip less. `call_after` callbacks run after
    COMMIT succeeded, `call_on_exception` callbacks after it rolled back or failed; both
    run only once the server has finished the transaction. Statements given to
    `send_with_commit` travel with COMMIT itself.

    `Database.transaction()` enters it on its connection: the block's exit commits, or
    rolls back on an exception (`psycopg.Rollback` ends the block quietly). COMMIT and
    ROLLBACK run to completion even if the calling task is cancelled meanwhile:
    callbacks must know how the transaction ended.
    """

    def __init__(
        self, conn: AsyncConnection[TupleRow], wal: WalProgress, wait_finished: WaitFinished
    ) -> None:
        self._conn = conn
        self._wal = wal
        self._wait_finished = wait_finished
        self._begun = False
        self._ended = False
        self._first_after_commit: list[Callable[[], None]] = []
        self._after_commit: list[Callable[[], None]] = []
        self._after_rollback: list[Callable[[], None]] = []
        self._with_commit: list[CommitStatement] = []
        # Set when something in the transaction learned its xid (see `allocate_in`), so
        # an interrupted COMMIT can be waited out instead of guessed.
        self.xid: str | None = None
        # The server process that ran COMMIT with statements: when the connection broke
        # meanwhile, plait waits until that process is gone (its work is then final).
        self.backend_pid: int | None = None
        # Where the WAL stood after the transaction took IDs (`allocate_in`); then COMMIT
        # also reads how far the WAL is on disk (`flushed_lsn`), in the same round trip:
        # a commit that wrote nothing flushes nothing (R-ID-14, `StreamStore`). So it
        # does while a `get_next` block is open (`WalProgress.watchers`): the block's
        # exit then knows without a round trip of its own.
        self.allocated_lsn = 0
        self.flushed_lsn: int | None = None

    async def __aenter__(self) -> Transaction:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is not None:
            try:
                _, cancelled = await to_the_end(self._end("ROLLBACK"))
            finally:
                self._run(self._after_rollback)
            if cancelled and not isinstance(exc, asyncio.CancelledError):
                raise asyncio.CancelledError from exc
            return isinstance(exc, psycopg.Rollback)  # rolled back on purpose: quietly
        try:
            _, cancelled = await to_the_end(self._end("COMMIT"))
        except BaseException as err:
            if isinstance(err, psycopg.OperationalError):  # did it commit? wait it out
                await self._wait_finished(xid=self.xid, backend_pid=self.backend_pid)
            self._run(self._after_rollback)
            raise
        self._run(self._first_after_commit)
        self._run(self._after_commit)
        if cancelled:
            raise asyncio.CancelledError
        return False

    async def execute(self, query: Any, params: Params = None) -> AsyncCursor[TupleRow]:
        if self._begun:
            return await self._conn.execute(query, params)
        if params is None and isinstance(query, str):
            # Without parameters both go in one simple query: one round trip, without
            # the client CPU that pipeline mode costs.
            self._begun = True
            cursor = await self._conn.execute("BEGIN; " + query)
            cursor.nextset()
            return cursor
        async with self._conn.pipeline():
            await self._begin()
            return await self._conn.execute(query, params)

    async def executemany(
        self,
        query: Any,
        params_seq: Iterable[Params],
        *,
        returning: bool = False,
    ) -> tuple[list[str] | None, list[list[TupleRow] | None]]:
        """`query` once per parameters, in one round trip (pipeline mode). With
        `returning`: the column names, and what each run returned, in order (None for
        a run that returned no rows at all); else (None, [])."""
        async with self._conn.pipeline():
            await self._begin()  # queued in the pipeline with the statements
            async with self._conn.cursor() as cursor:
                # A None in `params_seq` runs a statement without parameters (psycopg's
                # types leave that out).
                await cursor.executemany(query, params_seq, returning=returning)  # type: ignore[arg-type]
                if not returning:
                    return None, []
                columns: list[str] | None = None
                results: list[list[TupleRow] | None] = []
                while True:  # one result per run (`nextset`: psycopg 3.2 has no `results`)
                    if cursor.description is None:
                        results.append(None)
                    else:
                        columns = [column.name for column in cursor.description]
                        results.append(await cursor.fetchall())
                    if not cursor.nextset():
                        return columns, results

    async def connection(self) -> AsyncConnection[TupleRow]:
        """The connection, inside the transaction (for cursors, COPY, nested blocks)."""
        await self._begin()
        return self._conn

    async def _begin(self) -> None:
        if not self._begun:
            self._begun = True  # from here on, ending it sends ROLLBACK or COMMIT
            await self._conn.execute("BEGIN")

    def call_after(self, callback: Callable[[], None], *, first: bool = False) -> None:
        """Run `callback` once COMMIT succeeded; with `first`, before every callback
        registered without it (cache invalidations run before any stream ID of the
        transaction completes, so nothing sees the new position with stale caches)."""
        (self._first_after_commit if first else self._after_commit).append(callback)

    def call_on_exception(self, callback: Callable[[], None]) -> None:
        self._after_rollback.append(callback)

    @property
    def ended(self) -> bool:
        """Whether COMMIT or ROLLBACK was sent (nothing more can join the transaction)."""
        return self._ended

    def check_open(self) -> None:
        if self._ended:
            raise StateError(
                "this transaction has ended already; write inside the `async with "
                "db.transaction()` block"
            )

    def send_with_commit(self, statement: CommitStatement) -> None:
        """Send `statement` in the same round trip as COMMIT (pipelined), built only
        then: writes gathered during the transaction cost no round trip of their own."""
        self.check_open()
        self._with_commit.append(statement)
        self._after_rollback.append(statement.failed)

    async def _end(self, command: str) -> None:
        self._ended = True
        if command == "COMMIT" and self._with_commit:
            await self._commit_with_statements()
            return
        if not self._begun:
            return
        if command == "ROLLBACK" and self._conn.closed:
            # The session is gone (the server ended it: idle_in_transaction_session_timeout,
            # a terminated backend), and its transaction with it. Sending ROLLBACK would
            # only replace the error that says why with "the connection is closed".
            return
        if command == "COMMIT" and self._wants_flushed():
            # Pipelined and prepared: one round trip, and no parse or plan per commit.
            async with self._conn.pipeline():
                cursor = await self._conn.execute("COMMIT")
                flushed = await self._conn.execute(FLUSHED_LSN_QUERY, prepare=True)
            committed = cursor.statusmessage == "COMMIT"
            if committed:
                self._note_flushed(await flushed.fetchone())
        else:
            cursor = await self._conn.execute(command)
            committed = cursor.statusmessage == "COMMIT"
        if command == "COMMIT" and not committed:
            raise _rolled_back_at_commit()

    def _wants_flushed(self) -> bool:
        return bool(self.allocated_lsn or self._wal.watchers)

    def _note_flushed(self, row: tuple[Any, ...] | None) -> None:
        if row is not None:
            self.flushed_lsn = int(row[0])
            self._wal.flushed = max(self._wal.flushed, self.flushed_lsn)

    async def _commit_with_statements(self) -> None:
        """[BEGIN,] the statements and COMMIT in one pipeline: one round trip, and the
        statements stay prepared (psycopg prepares repeated ones)."""
        conn, statements = self._conn, self._with_commit
        built = [statement.statement() for statement in statements]
        self.backend_pid = server_pid(conn)
        for statement in statements:
            statement.sending()
        try:
            # Leaving the pipeline block sends the one Sync and reads every result.
            async with conn.pipeline():
                await self._begin()
                cursors = [await conn.execute(query, params) for query, params in built]
                commit = await conn.execute("COMMIT")
                flushed = (
                    await conn.execute(FLUSHED_LSN_QUERY, prepare=True)
                    if self._wants_flushed()
                    else None
                )
        except psycopg.errors.InFailedSqlTransaction:
            raise _rolled_back_at_commit() from None
        if commit.statusmessage != "COMMIT":
            raise _rolled_back_at_commit()
        if flushed is not None:
            self._note_flushed(await flushed.fetchone())
        for statement, cursor in zip(statements, cursors, strict=True):
            description = cursor.description
            if description is None:
                columns, records = None, None
            else:
                columns = [column.name for column in description]
                records = await cursor.fetchall()
            self._after_commit.append(functools.partial(statement.committed, columns, records))

    def _run(self, callbacks: list[Callable[[], None]]) -> None:
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("transaction callback %r failed", callback)


# How far the WAL is on disk, in bytes (an LSN as a number).
FLUSHED_LSN_QUERY = "SELECT pg_wal_lsn_diff(pg_current_wal_flush_lsn(), '0/0')::bigint"


def _rolled_back_at_commit() -> psycopg.errors.InFailedSqlTransaction:
    # The server answers COMMIT with ROLLBACK when a statement failed earlier.
    return psycopg.errors.InFailedSqlTransaction(
        "the transaction was rolled back at COMMIT because a statement in it failed "
        "earlier (and the error was caught); nothing was committed"
    )
