"""A generator's start: check the tables and sequence, load the positions and the
committed rows above them without scanning (R-ID-9), and register this writer once its
previous run is gone."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from plait.core.backoff import Backoff
from plait.core.positions import PositionTracker
from plait.core.spec import StreamSpec
from plait.errors import (
    InstanceRunningError,
)
from plait.storage.database import Database
from plait.storage.incarnation import name_prefix
from plait.storage.stream_store import STARTUP_PAGE, StreamStore, Survey
from plait.storage.writer_rows import Registered

logger = logging.getLogger(__name__)


async def load(
    db: Database, store: StreamStore, spec: StreamSpec, instance: str
) -> tuple[Survey, PositionTracker]:
    """Check the tables and sequence, load the positions, register this writer.

    A writer's own committed rows count as final at start-up (`load_tracker`), which
    holds once its previous run is over: registration waits until that run has no
    server process left (up to the database's patience), loading again each time."""
    if not await store.check_tables():
        await store.ensure_sequence()
    # Own latest row: only a configured writer of a stream with position rows.
    own = instance if spec.writers and instance in spec.writers else None

    loop = asyncio.get_running_loop()
    backoff = Backoff(initial=0.05, cap=1.0)
    waiting_since: float | None = None
    while True:
        survey = await store.survey(own)
        await store.check_sequence(survey)
        tracker = await load_tracker(store, spec, instance, survey)
        if not (spec.writers and tracker.is_writer):
            return survey, tracker
        # Registered before the first allocation, so database-only readers know
        # every live writer, and a fence of an earlier run cannot claim new IDs.
        previous = await store.writers.register(instance, tracker.local_position)
        if isinstance(previous, Registered):
            if previous.taken is None:
                return survey, tracker
            # Taken and given back unused: this run's first ID, finished already.
            tracker.end_fetch(tracker.begin_fetch(), [previous.taken], completed=True)
            return dataclasses.replace(survey, head=previous.taken), tracker
        if waiting_since is None:
            waiting_since = loop.time()
            logger.warning(
                "stream %s: the previous run of %s (epoch %d) still has %d connection(s) "
                "to PostgreSQL; waiting up to %.0f s for them to end before it starts",
                spec.name,
                instance,
                previous.epoch,
                previous.alive,
                db.patience,
            )
        # Then wait with a cheap count, no lock (fences need the row), and survey and
        # register again only once the previous run is gone.
        while (alive := await store.writers.connections_of(previous.epoch)) > 0:
            waited = loop.time() - waiting_since
            if waited >= db.patience:
                raise InstanceRunningError(
                    f"stream {spec.name!r}: cannot start {instance!r}: its previous run "
                    f"(epoch {previous.epoch}) still has {alive} server process(es) in "
                    f"PostgreSQL after {waited:.0f} s, so IDs it holds may still commit. "
                    f"Stop the process named {instance!r} if it still runs (two processes "
                    "must never write under one name); server processes it left behind "
                    "(pg_stat_activity rows whose application_name starts with "
                    f"{name_prefix(previous.epoch)!r}) end with pg_terminate_backend"
                )
            await asyncio.sleep(backoff.next_delay())


async def load_tracker(
    store: StreamStore, spec: StreamSpec, instance: str, survey: Survey
) -> PositionTracker:
    """Positions from `stream_positions` plus rows above them, without scanning (R-ID-9)."""
    positions = dict(survey.positions)
    writers = spec.writers or None
    if not positions:
        floor = max(1, survey.table_max or 1)
        return PositionTracker(instance, writers=writers, floor=floor)
    floor = min(positions.values())
    if survey.own_max is not None:
        positions[instance] = max(positions.get(instance, survey.own_max), survey.own_max)
    tracker = PositionTracker(
        instance, writers=writers, floor=floor, positions=positions, seat=False
    )
    await observe_committed(store, tracker, (survey.ids, survey.cutoff, survey.more), STARTUP_PAGE)
    tracker.seat_writers()
    return tracker


async def observe_committed(
    store: StreamStore, tracker: PositionTracker, first: tuple[list[int], int, bool], page: int
) -> None:
    """Feed `tracker` committed IDs (completed ones) from `first`, an `ids_above` answer,
    then page by page, until past the first gap: more rows cannot move persisted-up-to."""
    ids, cutoff, more = first
    while True:
        tracker.observe_completed(ids)
        if not more or tracker.persisted_upto < cutoff:
            return
        ids, cutoff, more = await store.rows.ids_above(cutoff, page)
