"""Group commit for small writes (opt-in): `Batcher` coalesces concurrent single-row
inserts of one statement into one transaction, as Kafka's producer batches concurrent
sends (`linger.ms`, `batch.size`).

A call waits at most `linger` seconds for others of the same statement text, or until
`max_batch` have gathered; then all of them run as one transaction, the statement once
per call in one round trip (`MultiWriterIdGenerator.insert_many_txn`), and each caller
gets the IDs its own row took. What that costs a caller: up to `linger`, then one commit.

Semantics, per batch:
- All rows of a batch commit together, or none does.
- A batch that failed before COMMIT, or that COMMIT refused (a constraint, a bad value,
  a deadlock, a connection lost mid-statement: it was rolled back for sure), is run
  again row by row, each on its own, so each caller gets its own answer: its IDs, or
  the error its own row causes. One bad row never fails the others.
- A batch whose COMMIT lost its answer (the connection failed during it: the rows may
  have committed) fails every caller with that error, as a lone `insert` would; so do
  plait's own errors (the writer fenced, the database unavailable). Running those rows
  again could write them twice.
- A caller cancelled while it waits leaves its row in the batch; like a cancelled
  `insert`, whether it was written is then unknown to it. A batch run again row by row
  skips the rows of callers cancelled by then.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

import psycopg

from plait.errors import ConfigError, StateError
from plait.storage.transaction import Params
from plait.tasks import TaskSet

if TYPE_CHECKING:
    from plait.streams.generator import MultiWriterIdGenerator

logger = logging.getLogger(__name__)

DEFAULT_LINGER = 0.002  # seconds
DEFAULT_MAX_BATCH = 100


@dataclasses.dataclass(slots=True)
class _Gathering:
    """The calls of one statement text waiting for their batch to leave."""

    calls: list[tuple[Params, asyncio.Future[list[int]]]]
    timer: asyncio.TimerHandle | None = None


class Batcher:
    """Coalesces concurrent `insert`s of one generator into group commits (see the
    module). Use as an async context manager, or call `aclose()`: it sends what is
    gathered and waits for every batch on its way."""

    def __init__(
        self,
        gen: MultiWriterIdGenerator,
        *,
        linger: float = DEFAULT_LINGER,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        if isinstance(linger, bool) or not isinstance(linger, int | float) or linger < 0:
            raise ConfigError(f"linger must be a number of seconds >= 0, not {linger!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be a whole number >= 1, not {max_batch!r}")
        self._gen = gen
        self._linger = float(linger)
        self._max_batch = max_batch
        self._gathering: dict[str, _Gathering] = {}
        self._batches = TaskSet(f"batcher of stream {gen.stream_name}")
        self._closed = False

    async def insert(self, query: str, params: Params = None) -> list[int]:
        """Like `MultiWriterIdGenerator.insert` (write `{id}` where the row's ID goes,
        end with `RETURNING <id column>`), run in a batch with concurrent calls of the
        same `query` text: the IDs this call's row took."""
        if self._closed:
            raise StateError("the batcher is closed: make a new one, or call gen.insert")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[int]] = loop.create_future()
        gathering = self._gathering.get(query)
        if gathering is None:
            # Once per batch: a statement without {id} fails here, alone; the calls that
            # join it have the same text.
            self._gen.check_statement(query)
            gathering = self._gathering[query] = _Gathering([])
            if self._linger > 0:
                gathering.timer = loop.call_later(self._linger, self._send, query)
            else:
                loop.call_soon(self._send, query)
        gathering.calls.append((params, future))
        if len(gathering.calls) >= self._max_batch:
            self._send(query)
        return await future

    def _send(self, query: str) -> None:
        gathering = self._gathering.pop(query, None)
        if gathering is None:
            return  # sent already (full before its linger ended)
        if gathering.timer is not None:
            gathering.timer.cancel()
        self._batches.start(self._run(query, gathering.calls), "plait-batch")

    async def _run(self, query: str, calls: list[tuple[Params, asyncio.Future[list[int]]]]) -> None:
        try:
            await self._batch(query, calls)
        finally:  # whatever happened, no caller waits for ever
            _fail(calls, StateError("the batch ended without an answer"))

    async def _batch(
        self, query: str, calls: list[tuple[Params, asyncio.Future[list[int]]]]
    ) -> None:
        gen = self._gen
        committing = False  # past the block: its exit sends COMMIT
        try:
            async with gen.store.db.transaction() as txn:
                results = await gen.insert_many_txn(txn, query, [p for p, _ in calls])
                committing = True
        except Exception as err:
            unknown = committing and isinstance(err, psycopg.OperationalError)
            if unknown or not isinstance(err, psycopg.Error) or len(calls) == 1:
                # COMMIT's answer was lost (it may have committed), or plait's own error
                # (fenced, the database unavailable), or nothing to split: as a lone insert.
                _fail(calls, err)
                return
            # Rolled back for sure: each row alone, so one bad row fails only its caller.
            logger.debug("stream %s: a batch of %d was refused (%s); row by row",
                         gen.stream_name, len(calls), err)  # fmt: skip
            await asyncio.gather(*(self._alone(query, params, f) for params, f in calls))
            return
        except BaseException:
            for _, future in calls:
                future.cancel()
            raise
        for (_, future), ids in zip(calls, results, strict=True):
            if not future.done():
                future.set_result(ids)

    async def _alone(self, query: str, params: Params, future: asyncio.Future[list[int]]) -> None:
        if future.done():
            return  # its caller was cancelled: it never learns, so nothing is written
        try:
            ids = await self._gen.insert(query, params)
        except Exception as err:
            _fail([(params, future)], err)
        else:
            if not future.done():
                future.set_result(ids)

    async def aclose(self) -> None:
        """Send what is gathered now and wait until every batch has its answer."""
        self._closed = True
        for query in list(self._gathering):
            self._send(query)
        await self._batches.wait()

    async def __aenter__(self) -> Batcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _fail(calls: list[tuple[Params, asyncio.Future[list[int]]]], err: BaseException) -> None:
    for _, future in calls:
        if not future.done():
            future.set_exception(err)
