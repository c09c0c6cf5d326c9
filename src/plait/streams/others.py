"""What one writer's generator knows of the other writers of its stream, and on whose
word it takes it.

A position of another writer moves this process's view of it (`advance`, `vouched`),
or only this writer's own idle position (`heard`, R-ID-5). A claim above the largest ID
this process knows the sequence handed out counts only once the sequence confirms it
(R-ID-14): a writer that took such a position would report it as its own. Stored
positions (`stream_positions`) are read when nothing else tells: by a database-only
reader (`refresh_positions`), by an idle replicated writer (`learn_stored_positions`),
and to prove a fence another process announced (`is_stored_at`). Values in and out of
the public methods are signed, as the generator's.
"""

from __future__ import annotations

import asyncio
import logging
import time

import psycopg

from plait.core.throttle import Throttle
from plait.errors import ConfigError, PlaitError
from plait.streams.shared import Shared
from plait.streams.startup import observe_committed
from plait.tasks import cancel_and_wait

logger = logging.getLogger("plait.streams.generator")  # what operators filter on

# IDs read per query when a database-only reader passes committed rows (the IDs between
# a slow writer's position and its pending ID are few; a gapless run goes on page by page).
PASS_PAGE = 1000


class OtherWriters:
    """The other writers' positions, as one writer's generator follows them."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        spec, tracker = shared.spec, shared.tracker
        self._sign = spec.sign
        # Any-writer streams keep no position rows (R-ID-12).
        self._keeps_rows = bool(spec.writers)
        self._heard_upto = tracker.max_seen  # when learn_stored_positions last looked
        self._passed_from = tracker.persisted_upto  # when _pass_committed_rows last looked
        # What the sequence is known to have handed out is `db.known_head` (the
        # generator's `create` notes the head it read). Another process's claim above it
        # counts only once the sequence confirms it (R-ID-14).
        self._head_lock = asyncio.Lock()
        # The highest stored position read per writer (`is_stored_at`; internal).
        self._stored_at_least: dict[str, int] = {}
        # Positions given to `advance` that a writer must check against the sequence
        # before it takes them (the largest per writer), and the task that checks.
        self._unconfirmed: dict[str, int] = {}
        self._confirming: asyncio.Task[None] | None = None
        self._refused_advances = Throttle(10.0)  # one warning per writer this often

    def advance(self, instance_name: str, position: int) -> None:
        """Another writer reached `position` (signed); never moves anything backwards.

        A writer takes a position above the largest ID it knows handed out only once
        the sequence confirms it (a moment later; one the sequence has not handed out
        is refused with a warning): it would otherwise report it as its own, and
        refuse its own next IDs. A reader takes it as given."""
        if isinstance(position, bool) or not isinstance(position, int):
            raise ConfigError(f"position must be an int, not {position!r}")
        internal = self._sign * position
        if internal < 1:
            raise ConfigError(
                f"position {position} of {instance_name!r} is not a valid position of "
                f"{'a backwards' if self._sign == -1 else 'a'} stream"
            )
        if not self._configured(instance_name):
            return
        if self._shared.tracker.is_writer and internal > self.known_head():
            # A writer that took an ID the sequence has not handed out would report it
            # as its own position (the idle rule), store it, and refuse its own next
            # IDs as "the sequence went backwards". Replication vouches for what it
            # passes on (`vouched`); a direct call is checked here, and the position
            # taken once the sequence has handed it out (R-ID-14).
            self._confirm_later(instance_name, internal)
            return
        self._shared.tracker.advance(instance_name, internal)

    def vouched(self, instance_name: str, position: int) -> None:
        """`advance`, for a position replication vouches for: checked against the
        sequence on an unauthenticated link, or an authenticated writer's word about
        its own IDs. Taken at once: asking the sequence about every position of the
        other writers would cost a query per position while they write."""
        if self._configured(instance_name):
            internal = self._sign * position
            # Handed out, as far as this process knows: a crash may not take the
            # sequence back below it (`Database.known_head`).
            # A writer checks it soon after a restart (it allocates; readers need not).
            self._shared.db.note_head(
                self._shared.spec.sequence, internal, heard=self._shared.tracker.is_writer
            )
            self._shared.tracker.advance(instance_name, internal)

    def heard(self, instance_name: str, position: int) -> None:
        """A position of another writer, vouched for as in `vouched`, heard before
        this process handled the rows before it: it moves this writer's own position
        while idle (`PositionTracker.learn_completed`), and nothing else. A writer
        whose listeners (or catch-ups) lag behind what it hears then still follows the
        others, or every reader's linear position would lag with it (R-ID-5). Like
        `vouched`, it pokes nothing: the idle move is stored and announced on their own
        schedules (once per interval), not once per token heard."""
        internal = self._sign * position
        tracker = self._shared.tracker
        if internal <= tracker.max_seen or not tracker.is_writer:
            return  # no news, or no position of its own
        if not self._configured(instance_name):
            return
        self._shared.db.note_head(self._shared.spec.sequence, internal, heard=True)
        tracker.learn_completed(internal)

    def _configured(self, writer: str) -> bool:
        """Whether `writer`'s positions count here. The configured writers are
        authoritative (start-up drops the rows of others too): a late message from a
        removed writer must not hold the linear position back forever."""
        if not self._shared.spec.writers or writer in self._shared.spec.writers:
            return True
        logger.debug(
            "stream %s: ignoring position of %r, not a configured writer",
            self._shared.spec.name,
            writer,
        )
        return False

    def _confirm_later(self, writer: str, position: int) -> None:
        if position <= self._unconfirmed.get(writer, 0) or self._shared.closed():
            return
        self._unconfirmed[writer] = position
        if self._confirming is None or self._confirming.done():
            self._confirming = asyncio.get_running_loop().create_task(
                self._confirm_positions(), name=f"plait-confirm-{self._shared.spec.name}"
            )

    async def _confirm_positions(self) -> None:
        """Take the positions `advance` was given above the known head once the
        sequence confirms them; refuse (and say so) the ones it has not handed out."""
        while self._unconfirmed:
            writer, position = self._unconfirmed.popitem()
            try:
                allocated = await self.is_allocated(self._sign * position)
            except (psycopg.Error, PlaitError) as err:
                logger.warning(
                    "stream %s: could not check %s's position %d against the sequence "
                    "(%s); not taking it (a later one will be)",
                    self._shared.spec.name,
                    writer,
                    self._sign * position,
                    err,
                )
                continue
            if allocated:
                before = self._shared.tracker.local_position
                self._shared.tracker.advance(writer, position)
                self._shared.poke_if_moved(before)
            elif (held := self._refused_advances.allow(writer, time.monotonic())) is not None:
                logger.warning(
                    "stream %s: not taking position %d of %s given to advance(): sequence "
                    "%s has handed out IDs up to %d only, so it names no ID (a wrong, "
                    "forged or corrupted position); %s goes on at %d%s",
                    self._shared.spec.name,
                    self._sign * position,
                    writer,
                    self._shared.spec.sequence,
                    self._sign * self.known_head(),
                    self._shared.instance_name,
                    self._sign * self._shared.tracker.position_of(self._shared.instance_name),
                    f"; {held} more refused since the last warning" if held else "",
                )

    def known_head(self) -> int:
        return self._shared.db.known_head(self._shared.spec.sequence)

    def handed_out(self, stream_id: int) -> None:
        """This writer took IDs up to `stream_id` (internal) from the sequence."""
        self._shared.db.note_head(self._shared.spec.sequence, stream_id)

    async def get_max_allocated_token(self) -> int:
        """The largest ID the sequence has handed out (signed)."""
        head = await self._shared.store.sequence_head()
        self._shared.db.note_head(self._shared.spec.sequence, head)
        return self._sign * head

    def is_known_allocated(self, position: int) -> bool:
        """Whether `position` (signed) is at or below the largest ID this process knows
        the sequence handed out; no query. False says only "not known yet": ask
        `is_allocated`."""
        return self._sign * position <= self.known_head()

    async def is_allocated(self, position: int) -> bool:
        """Whether the sequence has handed out `position` (signed). A position above
        the head names no ID and is never to be adopted, stored or waited on (R-ID-14).
        Reads the head only when the one known is below `position`; callers that ask
        meanwhile share that read."""
        internal = self._sign * position
        if internal <= self.known_head():
            return True
        async with self._head_lock:
            if internal > self.known_head():
                self._shared.db.note_head(
                    self._shared.spec.sequence, await self._shared.store.sequence_head()
                )
        return internal <= self.known_head()

    async def is_stored_at(self, writer: str, position: int) -> bool:
        """Whether `writer`'s position in `stream_positions` is at or past `position`
        (signed): written there by the writer itself or by a fence that proved it dead,
        so a fence another instance announces is a fact once this holds (R-ID-14)."""
        internal = self._sign * position
        if internal > self._stored_at_least.get(writer, 0):
            # Stored positions only grow (and never pass the head): read once per claim
            # above the highest read.
            for name, stored in (
                await self._shared.store.load_positions(drop_others=False)
            ).items():
                self._stored_at_least[name] = max(self._stored_at_least.get(name, 0), stored)
        return internal <= self._stored_at_least.get(writer, 0)

    async def refresh_positions(self) -> None:
        """Learn the other writers' positions from `stream_positions`."""
        if not self._keeps_rows:
            return
        # Only configured writers' rows come back; our own is ignored by the tracker.
        # Stored positions are at or below the head (`StreamStore.upsert_position`).
        for writer, position in (
            await self._shared.store.load_positions(drop_others=False)
        ).items():
            self._shared.db.note_head(self._shared.spec.sequence, position)
            self._shared.tracker.advance(writer, position)
        await self._pass_committed_rows()

    async def _pass_committed_rows(self) -> None:
        """Move persisted-up-to over committed rows above it that leave no gap (R-ID-4).

        A writer whose ID waits in a long transaction stands at its last finished ID,
        while the others commit IDs between that and its pending one. A reader fed by
        replication passes those as their rows arrive; one that follows the database
        learns no IDs from rows, so it reads them, once persisted-up-to stood still for
        a whole refresh with a writer past it (no query while positions move)."""
        tracker = self._shared.tracker
        persisted = tracker.persisted_upto
        stood_still, self._passed_from = persisted == self._passed_from, persisted
        if not stood_still or max(tracker.positions().values(), default=0) <= persisted:
            return
        first = await self._shared.store.rows.ids_above(persisted, PASS_PAGE)
        await observe_committed(self._shared.store, tracker, first, PASS_PAGE)
        self._passed_from = tracker.persisted_upto

    async def learn_stored_positions(self) -> None:
        """A replicated writer, while idle: the others' stored positions move its own
        (`PositionTracker.learn_completed`). Replication moves it as soon as it hears
        the others; this keeps it moving while it hears nothing (Redis down, or out of
        its reach), or readers of the database alone would stall on it (R-ID-8)."""
        tracker = self._shared.tracker
        heard, self._heard_upto = self._heard_upto, tracker.max_seen
        if not tracker.is_idle or tracker.max_seen > heard:
            return  # busy, or replication moved it since the last look: no query
        stored = await self._shared.store.load_positions(drop_others=False)
        others = [
            position for writer, position in stored.items() if writer != self._shared.instance_name
        ]
        if others:
            before = tracker.local_position
            tracker.learn_completed(max(others))
            self._heard_upto = tracker.max_seen  # what it learned here is no news next time
            self._shared.poke_if_moved(before)

    async def close(self) -> None:
        """Stop checking positions against the sequence (unchecked ones are not taken)."""
        if self._confirming is not None:
            await cancel_and_wait(self._confirming)
