"""Streams as the replication handler sees them: database-backed or in-memory.

The handler works in the *internal* domain, where tokens always grow: a backwards
stream's signed tokens are negated at the edge (commands and callbacks carry signed
values, like the rest of plait's API). Everything here is a thin adapter over the ID
generator or the in-memory stream; the reading itself is theirs.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from plait.replication.metrics import ReplicationMetrics
from plait.replication.rows import BatchRowCodec, RowCodec
from plait.streams.generator import MultiWriterIdGenerator
from plait.streams.memory import MemoryStream, ReadPage
from plait.streams.outbox import Outbox

# Rows read per query when sending own rows as RDATA.
SEND_PAGE = 1000


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """Rows read while catching up: row values in order, every row of the writer in
    (from, upto]; `reset` as in `ReadPage`."""

    rows: list[Any]
    upto: int
    limited: bool
    reset: bool = False


class ReplicatedStream(Protocol):
    """A stream the handler replicates, in the internal domain."""

    @property
    def name(self) -> str: ...

    @property
    def sign(self) -> int:
        """-1 for backwards streams: signed token = sign * internal token."""
        ...

    @property
    def writers(self) -> frozenset[str] | None:
        """The configured writers, or None when any instance may write."""
        ...

    @property
    def durable(self) -> bool:
        """Whether every row stays readable from the database: a process that hands
        no rows to anyone may then move past a writer's rows without reading them."""
        ...

    def seen(self, writer: str) -> int:
        """How far this process has seen `writer`'s rows."""
        ...

    def is_known_allocated(self, token: int) -> bool:
        """Whether `token` is known to name an ID that exists (no I/O): a position
        claimed above the stream's head is a lie or a bug, never a fact (R-ID-14)."""
        ...

    async def is_allocated(self, token: int) -> bool:
        """`is_known_allocated`, asking the source of truth when it is not known."""
        ...

    async def is_proven_fence(self, writer: str, token: int) -> bool:
        """Whether a fence of `writer` up to `token`, announced by another instance, is
        a fact: the writer's stored position is at or past it."""
        ...

    def advance(self, writer: str, token: int) -> None:
        """This process has seen every row of `writer` up to `token` (never backwards)."""
        ...

    def heard(self, writer: str, token: int) -> None:
        """`writer` said it reached `token`, before this process handled what came
        before: it moves this instance's own idle position only (R-ID-5)."""
        ...

    def own_position(self) -> int | None:
        """This instance's position as a writer of the stream; None when it is not one."""
        ...

    def read_known(self, from_exclusive: int, to_inclusive: int) -> ReadPage | None:
        """This instance's rows in (from, to] as JSON values, when known without a
        query (the outbox holds them); None when they must be read back (`read_own`)."""
        ...

    async def read_own(self, from_exclusive: int, to_inclusive: int) -> ReadPage:
        """This instance's rows in (from, to], as JSON values, to send as RDATA: from
        the outbox when it holds them all (no query), else read back."""
        ...

    def catch_up(
        self, writer: str, from_exclusive: int, to_inclusive: int, first: int, most: int
    ) -> AsyncGenerator[CaughtUp, None]:
        """`writer`'s rows in (from, to] that this process missed, as row values, in
        pages of `first` rows growing to `most`; the last page ends at `to`."""
        ...

    def decode(self, value: Any) -> Any:
        """A row that arrived as JSON, as a row value."""
        ...

    def open_outbox(self, reader: Callable[[], None] | None = None) -> Outbox:
        """Where this process's writer of the stream posts its writes, position moves
        and fences for the sender; it keeps what `read_own` needs from each own write
        from now on (call it before the first write). `reader`, once given, is
        scheduled on the event loop after posts."""
        ...

    def positions(self) -> dict[str, int]:
        """Signed positions of the writers seen (for metrics)."""
        ...

    def persisted_upto(self) -> int:
        """Signed linear position (for metrics)."""
        ...

    def oldest_unfinished_age(self) -> float | None:
        """Seconds the work holding this instance's own position has been pending;
        None when not a writer here or nothing is pending (for metrics)."""
        ...


class DatabaseStream:
    """A stream stored in PostgreSQL, through its ID generator. The generator must not
    follow the database on its own (`follow_database=False`): positions of other
    writers may move only when their rows were delivered, or rows would be skipped."""

    def __init__(
        self,
        gen: MultiWriterIdGenerator,
        codec: RowCodec[Any],
        metrics: ReplicationMetrics | None = None,
    ) -> None:
        self._gen = gen
        self._read_back_rows = (
            None if metrics is None else metrics.rows_read_back.labels(gen.stream_name)
        )
        self._codec = codec
        self._sign = gen.spec.sign
        self._own = gen.instance_name
        spec = gen.spec
        self._writers = frozenset(spec.writers) if spec.writers else None
        # How far this process has delivered each other writer: where the generator
        # had it at start-up, then only what the handler advanced. A writer it did not
        # know (any-writer streams; a configured writer without a position row) starts
        # where this process started: the generator would answer with persisted-up-to,
        # which this process's own writes move past that writer's rows still on the way.
        sign = self._sign
        self._start = sign * gen.get_persisted_upto_position()
        self._seen = {
            writer: sign * position
            for writer, position in gen.get_positions().items()
            if writer != self._own
        }

    @property
    def name(self) -> str:
        return self._gen.stream_name

    @property
    def sign(self) -> int:
        return self._sign

    @property
    def writers(self) -> frozenset[str] | None:
        return self._writers

    @property
    def generator(self) -> MultiWriterIdGenerator:
        return self._gen

    @property
    def durable(self) -> bool:
        return True

    def seen(self, writer: str) -> int:
        return self._seen.get(writer, self._start)

    def is_known_allocated(self, token: int) -> bool:
        return self._gen.is_known_allocated(self._sign * token)

    async def is_allocated(self, token: int) -> bool:
        return await self._gen.is_allocated(self._sign * token)

    async def is_proven_fence(self, writer: str, token: int) -> bool:
        return await self._gen.is_stored_at(writer, self._sign * token)

    def advance(self, writer: str, token: int) -> None:
        if token <= self._seen.get(writer, self._start):
            return
        self._seen[writer] = token
        self._gen.vouched(writer, self._sign * token)

    def heard(self, writer: str, token: int) -> None:
        self._gen.heard(writer, self._sign * token)

    def own_position(self) -> int | None:
        if not self._gen.is_writer:
            return None
        return self._sign * self._gen.get_current_token_for_writer(self._own)

    def open_outbox(self, reader: Callable[[], None] | None = None) -> Outbox:
        return self._gen.open_outbox(reader)

    def read_known(self, from_exclusive: int, to_inclusive: int) -> ReadPage | None:
        outbox = self._gen.outbox
        found = outbox.known(from_exclusive, to_inclusive)
        if found is None:
            return None
        codec, upto, limited = self._codec, to_inclusive, False
        out: list[tuple[int, Any]] = []
        for n, (stream_id, rows) in enumerate(found):
            if len(out) >= SEND_PAGE:  # cut between IDs
                upto, limited = found[n - 1][0], True
                break
            out.extend((stream_id, codec.to_json(codec.from_db(row))) for row in rows)
        outbox.sent_upto(upto)
        return ReadPage(out, upto, limited)

    async def read_own(self, from_exclusive: int, to_inclusive: int) -> ReadPage:
        page = self.read_known(from_exclusive, to_inclusive)
        if page is not None:
            return page
        page = await self._read_back(from_exclusive, to_inclusive)
        if self._read_back_rows is not None:
            self._read_back_rows.inc(len(page.rows))
        self._gen.outbox.sent_upto(page.upto)
        return page

    async def _read_back(self, from_exclusive: int, to_inclusive: int) -> ReadPage:
        codec = self._codec
        rows, upto, limited = await self._gen.get_updates_since(
            self._own, self._sign * from_exclusive, self._sign * to_inclusive, SEND_PAGE
        )
        return ReadPage(
            [(self._sign * r.stream_id, codec.to_json(codec.from_db(r))) for r in rows],
            self._sign * upto,
            limited,
        )

    async def catch_up(
        self, writer: str, from_exclusive: int, to_inclusive: int, first: int, most: int
    ) -> AsyncGenerator[CaughtUp, None]:
        codec = self._codec
        # The default row type builds its rows from the database's tuples directly.
        single = len(self._gen.spec.tables) == 1
        maker = codec.row_maker if single and isinstance(codec, BatchRowCodec) else None
        # The store reads in the internal domain, like this class.
        pages = self._gen.store.rows.scan(writer, from_exclusive, to_inclusive, first, most, maker)
        async with contextlib.aclosing(pages):
            async for page in pages:
                rows = page.rows if maker is not None else list(map(codec.from_db, page.rows))
                yield CaughtUp(rows, page.upto, page.limited)

    def decode(self, value: Any) -> Any:
        return self._codec.from_json(value)

    def positions(self) -> dict[str, int]:
        return self._gen.get_positions()

    def persisted_upto(self) -> int:
        return self._gen.get_persisted_upto_position()

    def oldest_unfinished_age(self) -> float | None:
        return self._gen.oldest_unfinished_age()


class CatchUpClient(Protocol):
    """Reads another instance's in-memory stream (the internal HTTP API's client)."""

    async def catch_up(
        self, instance: str, stream: str, from_exclusive: int, to_inclusive: int, limit: int
    ) -> ReadPage:
        """A page of the writer's rows as JSON values."""
        ...


class InMemoryStream:
    """An in-memory stream: this instance's own rows (when it is a writer) live in a
    `MemoryStream`; the rows of other writers are read from them over HTTP."""

    def __init__(
        self,
        name: str,
        instance_name: str,
        writers: frozenset[str],
        codec: RowCodec[Any],
        client: Callable[[], CatchUpClient],
    ) -> None:
        self._name = name
        self._own = instance_name
        self._writers = writers
        self._codec = codec
        self._client = client
        self.memory = MemoryStream(name) if instance_name in writers else None
        # What the sender drains: the moves of this process's own writes, if any
        # (nothing is fenced: in-memory rows are caught up from their writer).
        self._outbox = Outbox() if self.memory is None else self.memory.outbox
        self._seen: dict[str, int] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def sign(self) -> int:
        return 1

    @property
    def writers(self) -> frozenset[str] | None:
        return self._writers

    def seen(self, writer: str) -> int:
        if writer == self._own and self.memory is not None:
            return self.memory.position
        return self._seen.get(writer, 0)

    # In-memory streams have no sequence: positions are counters of their writer,
    # whose catch-up over HTTP serves only rows it has (a claim past them fails it).
    def is_known_allocated(self, token: int) -> bool:
        return True

    async def is_allocated(self, token: int) -> bool:
        return True

    async def is_proven_fence(self, writer: str, token: int) -> bool:
        return False  # nobody fences the writer of an in-memory stream

    def advance(self, writer: str, token: int) -> None:
        if token > self._seen.get(writer, 0):
            self._seen[writer] = token

    def heard(self, writer: str, token: int) -> None:
        pass  # a memory stream's writer counts by its own clock: no idle rule

    def own_position(self) -> int | None:
        return None if self.memory is None else self.memory.position

    @property
    def durable(self) -> bool:
        return False  # a restarted writer's rows are gone, and the reset must be heard

    def read_known(self, from_exclusive: int, to_inclusive: int) -> ReadPage:
        return self.read_json(from_exclusive, to_inclusive, SEND_PAGE)

    async def read_own(self, from_exclusive: int, to_inclusive: int) -> ReadPage:
        return self.read_known(from_exclusive, to_inclusive)

    def read_json(self, from_exclusive: int, to_inclusive: int, limit: int) -> ReadPage:
        """Own rows as JSON values: to send them, and for another instance's catch-up
        (served over HTTP); KeyError when this instance does not write the stream."""
        if self.memory is None:
            raise KeyError(self._name)
        page = self.memory.read(from_exclusive, to_inclusive, limit)
        to_json = self._codec.to_json
        return ReadPage(
            [(t, to_json(r)) for t, r in page.rows], page.upto, page.limited, page.reset
        )

    async def catch_up(
        self, writer: str, from_exclusive: int, to_inclusive: int, first: int, most: int
    ) -> AsyncGenerator[CaughtUp, None]:
        from_json, low, size = self._codec.from_json, from_exclusive, first
        while True:
            page = await self._client().catch_up(writer, self._name, low, to_inclusive, size)
            rows = [from_json(r) for _, r in page.rows]
            yield CaughtUp(rows, page.upto, page.limited, page.reset)
            if not page.limited:
                return
            low, size = page.upto, min(2 * size, most)

    def decode(self, value: Any) -> Any:
        return self._codec.from_json(value)

    def open_outbox(self, reader: Callable[[], None] | None = None) -> Outbox:
        self._outbox.open(reader)  # own rows live in `memory`: only moves are posted
        return self._outbox

    def positions(self) -> dict[str, int]:
        positions = dict(self._seen)
        if self.memory is not None:
            positions[self._own] = self.memory.position
        return positions

    def persisted_upto(self) -> int:
        return min(self.positions().values(), default=0)

    def oldest_unfinished_age(self) -> float | None:
        return None  # in-memory writes finish as they are made
