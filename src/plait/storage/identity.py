"""Who a pool's connections say they are: the settings each new one starts with, the
sequences it catches up after a crash, and what happens when it finds its run fenced."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import psycopg
from psycopg import AsyncConnection, sql
from psycopg.rows import TupleRow

from plait.core.throttle import Throttle
from plait.errors import (
    FencedError,
    SupersededError,
)
from plait.storage.incarnation import (
    Incarnation,
    name_connection,
    refuse_if_fenced,
    renew_incarnation,
)

logger = logging.getLogger(__name__)


class Identity:
    """Who a pool's connections say they are, the server settings each one starts
    with, and what happens when a new one finds that run fenced.

    With `renew` (the default), the instance goes on as a new incarnation: a fence
    proved that none of the old one's connections was alive, so everything it did is
    committed or rolled back. The new connection takes a new epoch's name and moves
    the fenced rows to that epoch before it is handed out, under their row locks, so no
    allocation happens before the writer is registered again and a fence in progress
    is waited out. But only once nothing of the old run is pending (`holds`): an ID it
    took before the fence, still held by a `get_next` block, could otherwise be
    written on a new connection below the position the fence moved readers past.
    Until then, and always without `renew`, every lease fails at once (`FencedError`).
    A run superseded by a later run of the instance never goes on (`SupersededError`):
    the later one writes under that name now."""

    __slots__ = (
        "_catching_up",
        "_renewing",
        "_sequence_warnings",
        "fenced",
        "heads",
        "heard",
        "holds",
        "incarnation",
        "pooled",
        "registered",
        "renew",
        "renewed",
        "restarted_at",
        "server_start",
        "settings",
        "superseded",
    )

    def __init__(
        self,
        incarnation: Incarnation | None = None,
        settings: Mapping[str, str] | None = None,
        *,
        renew: bool = True,
    ) -> None:
        self.incarnation = incarnation
        self.settings = dict(settings or {})
        # The largest ID (internal domain) this process knows each sequence handed
        # out (`Database.known_head`); new connections bring a sequence that went
        # back up to it first (`_catch_up_sequences`).
        self.heads: dict[str, int] = {}
        # Heads heard from other processes soon after PostgreSQL restarted, not yet
        # caught up to (`Database.note_head`); when the server started, as the
        # connections made so far saw it, and when a new one found it restarted.
        self.heard: dict[str, int] = {}
        self._catching_up = asyncio.Lock()
        self.server_start: datetime | None = None
        self.restarted_at: float | None = None
        self._sequence_warnings = Throttle(60.0)  # per sequence, not per connection
        self.fenced: FencedError | None = None
        self.renew = renew
        # Each says whether IDs of this run are still pending (the writers' trackers).
        self.holds: list[Callable[[], bool]] = []
        # The streams this run registered its epoch on (`Database.registered`).
        self.registered: set[str] = set()
        # Called with the new incarnation (the pool names later connections after it).
        self.renewed: Callable[[Incarnation], None] | None = None
        # Called once when a later run of the instance superseded this one.
        self.superseded: list[Callable[[], None]] = []
        self._renewing = asyncio.Lock()  # one renewal at a time
        # A pooler sits between plait and the server (`probe`): each connection learns
        # the id of the server process behind it (`server_pid`).
        self.pooled = False

    def may_renew(self) -> bool:
        if isinstance(self.fenced, SupersededError):
            return False
        return self.renew and not any(pending() for pending in self.holds)

    async def configure(self, conn: AsyncConnection[TupleRow]) -> None:
        """The pool's hook for each new connection. One it refuses is closed here:
        psycopg_pool drops it unclosed, and its server process, named after this run,
        would live on until the garbage collector got to it, keeping a fenced run
        looking alive to the others' fences while it retried (issue 18)."""
        try:
            await self._configure(conn)
        except BaseException:
            await conn.close()
            raise

    async def _configure(self, conn: AsyncConnection[TupleRow]) -> None:
        if self.settings or self.pooled:
            # SET after connecting rather than `options` in the startup packet, which
            # PgBouncer refuses: one round trip per new connection, which also asks for
            # the server process's id behind a pooler.
            cursor = await conn.execute(_set_query(self.settings, with_pid=self.pooled))
            if self.pooled:
                row = await cursor.fetchone()
                assert row is not None
                _SERVER_PIDS[conn] = int(row[0])
        # The sequences first, then the fence: a run that finds itself fenced finishes
        # the IDs it took (`Finisher.finish_flushed`), trusting that the
        # sequence is durably past them; after a crash that took the sequence back
        # only this catch-up makes it so (its nextval logs, and its commit flushes).
        # Moving a sequence up is harmless for a fenced run: it writes no row.
        if self.heads or self.incarnation is not None:  # a writer's, or one that knows heads
            await self._catch_up_sequences(conn, self.heads, new=True)
        await self._check_fence(conn)

    def must_catch_up(self) -> bool:
        """Whether a lease must `catch_up_heard` before its statement (cheap: it runs
        before every statement)."""
        return bool(self.heard) or self._catching_up.locked()

    async def catch_up_heard(self, conn: AsyncConnection[TupleRow]) -> None:
        """Catch up the heads in `heard`, one lease at a time: the others wait for it,
        then find nothing left or what was heard meanwhile (kept when the connection
        breaks)."""
        async with self._catching_up:
            heard, self.heard = self.heard, {}
            if not heard:
                return
            try:
                await self._catch_up_sequences(conn, heard, new=False)
            except BaseException:
                for name, head in heard.items():
                    self.heard[name] = max(head, self.heard.get(name, 0))
                raise

    def _note_server_start(self, started: datetime | None) -> None:
        if self.server_start is not None and started != self.server_start:
            self.restarted_at = time.monotonic()
        self.server_start = started

    async def _catch_up_sequences(
        self, conn: AsyncConnection[TupleRow], heads: Mapping[str, int], *, new: bool
    ) -> None:
        """Move each sequence this process took or saw IDs from back up to the largest
        it knows was handed out, before the connection serves anything (R-ID-14).

        PostgreSQL logs a sequence 32 values ahead, and that log record reaches the
        disk only when something flushes the WAL (a commit, the WAL writer). A crash
        soon after a transaction that took IDs rolled back can bring the sequence back
        below them, to hand them out again; a writer may have reported one as its
        position (finished, without a row), and readers passed it. After a crash
        every statement runs on a new connection, so this comes first. A `new`
        connection also says when the server started (same round trip): a head heard
        from another process soon after a restart is caught up too (`Database.note_head`)."""
        by_text = {regclass_text(name): name for name in heads}
        params = {
            "names": list(by_text),
            "known": [heads[name] for name in by_text.values()],
            "limit": SEQUENCE_CATCH_UP_LIMIT,
        }
        try:
            if new:
                async with conn.pipeline():
                    started = await conn.execute("SELECT pg_postmaster_start_time()")
                    caught_up = await conn.execute(_CATCH_UP_QUERY, params) if heads else None
                row = await started.fetchone()
                self._note_server_start(None if row is None else row[0])
            else:
                caught_up = await conn.execute(_CATCH_UP_QUERY, params)
            rows = [] if caught_up is None else await caught_up.fetchall()
        except psycopg.Error as err:
            if conn.broken:
                raise
            if self._sequence_warnings.allow("check", time.monotonic()) is not None:
                logger.warning("could not check the streams' sequences (new connection): %s", err)
            return
        for text, known, head, taken in rows:
            name = by_text.get(text, text)
            if taken:
                logger.warning(
                    "sequence %s was at %d, below ID %d that it handed out before: a "
                    "PostgreSQL crash lost its last log record. Took %d value(s) from it "
                    "so that no ID is handed out twice",
                    name,
                    head,
                    known,
                    taken,
                )
            elif self._sequence_warnings.allow(name, time.monotonic()) is not None:
                logger.error(
                    "sequence %s is at %d, %d below ID %d that it handed out before: more "
                    "than a crash takes back, so it was reset. Not moving it; writers "
                    "refuse IDs at or below the ones they saw (SequenceBehindError)",
                    name,
                    head,
                    known - head,
                    known,
                )

    async def _check_fence(self, conn: AsyncConnection[TupleRow]) -> None:
        """Refuse the connection when this run was fenced, or renew the incarnation."""
        checked = self.incarnation
        if checked is None:
            return
        try:
            await refuse_if_fenced(conn, checked, self.registered)
        except FencedError as err:
            if isinstance(err, SupersededError):
                # Rows under an epoch not `checked`'s: a later run's, or this run's own
                # renewal (another connection, under way or just done). Check again.
                async with self._renewing:
                    renewed = self.incarnation is not checked
                if renewed:
                    await self._check_fence(conn)
                    return
            if isinstance(err, SupersededError) or not self.may_renew():
                first = isinstance(err, SupersededError) and not isinstance(
                    self.fenced, SupersededError
                )
                self.fenced = err
                if first:
                    for listener in self.superseded:
                        listener()
                raise
            async with self._renewing:
                if self.incarnation is checked:  # else another connection renewed
                    new = Incarnation.new(checked.instance)
                    # The rows move first (committed), the name switches after: if
                    # this fails, the next connection finds the old run fenced again
                    # and retries, rather than living on under a name nobody fences by.
                    await renew_incarnation(conn, checked, new)
                    self.incarnation, self.fenced = new, None
                    logger.warning(
                        "%s; continuing as a new incarnation (epoch %d): its writers are "
                        "registered again before they allocate",
                        str(err).split(": another instance", 1)[0],
                        new.epoch,
                    )
                    if self.renewed is not None:
                        self.renewed(new)
                    return
        current = self.incarnation
        assert current is not None
        if conn.info.parameter_status("application_name") != current.application_name:
            # Made under the old name while another connection renewed: a fence
            # counts only connections carrying the registered epoch's name.
            await name_connection(conn, current)


# How long after a new connection found PostgreSQL restarted a head heard from another
# process is caught up before this process's next statement (`Database.note_head`):
# longer than a position message sent before the crash takes to arrive once the server
# is back. It costs one more statement before each statement of a writer that heard a
# head above the ones it knew, within this window only (about half its write rate).
HEARD_AFTER_RESTART = 10.0

# Values a sequence is moved up by at most (`_catch_up_sequences`): far more than a
# crash takes it back. One further behind was reset, not crashed: left alone (start-up
# refuses to go on from a sequence behind the stored positions, `SequenceBehindError`).
SEQUENCE_CATCH_UP_LIMIT = 1_000_000

# For each sequence below what this process knows it handed out: its head, and the
# values taken to bring it up, with nextval, which never moves a sequence back (setval's
# read-then-set would race with others' nextval). Skipped: sequences gone, not
# sequences, not ours to use, never called or reset with setval(..., false) (no head to
# compare), and ones further behind than the limit.
_CATCH_UP_QUERY = """
WITH known AS MATERIALIZED (
    SELECT c.oid::regclass AS seq, u.name, u.known
    FROM unnest(%(names)s::text[], %(known)s::bigint[]) AS u(name, known)
    JOIN pg_class c ON c.oid = to_regclass(u.name)
    -- CASE: the privilege check errs on a relation that is not a sequence.
    WHERE CASE WHEN c.relkind = 'S' THEN has_sequence_privilege(c.oid, 'USAGE') END
), behind AS (
    SELECT seq, name, known, pg_sequence_last_value(seq) AS head FROM known
)
SELECT b.name, b.known, b.head, CASE WHEN b.known - b.head > %(limit)s THEN 0 ELSE (
    SELECT count(v) FROM (SELECT nextval(b.seq) AS v FROM generate_series(1, b.known - b.head)) x
) END
FROM behind b
WHERE b.head < b.known
"""


def regclass_text(name: str) -> str:
    """A table or sequence name, schema-qualified or not, as text for `::regclass`."""
    # Names are validated by StreamSpec (no quotes), so this quoting is exact.
    return ".".join(f'"{part}"' for part in name.split("."))


def _set_query(settings: Mapping[str, str], *, with_pid: bool = False) -> sql.Composed:
    columns: list[sql.Composable] = [sql.SQL("pg_backend_pid()")] if with_pid else []
    columns.extend(
        sql.SQL("set_config({}, {}, false)").format(sql.Literal(name), sql.Literal(value))
        for name, value in settings.items()
    )
    return sql.SQL("SELECT {}").format(sql.SQL(", ").join(columns))


# The server process behind each connection made through a pooler, which gives its
# clients process ids of its own at login (`BackendKeyData`, `conn.info.backend_pid`).
_SERVER_PIDS: weakref.WeakKeyDictionary[AsyncConnection[Any], int] = weakref.WeakKeyDictionary()


def server_pid(conn: AsyncConnection[Any]) -> int:
    """The id of the PostgreSQL process serving `conn`, as pg_stat_activity knows it
    (what `Database.wait_finished` waits on), also behind PgBouncer."""
    return _SERVER_PIDS.get(conn) or conn.info.backend_pid
