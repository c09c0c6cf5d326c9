"""`Instance`: one plait process. It owns the database pool, the ID generators of its
streams, the replication handler and transport, and the internal HTTP API (with the
metrics endpoint), and starts and stops them in order.

    instance = Instance(config)            # an InstanceConfig, a mapping, or from_yaml()
    instance.on_rows("events", callback)   # register before start()
    async with instance:                   # start() ... stop()
        async with instance.generator("events").get_next() as stream_id: ...

Registration (row types, listeners, commands, endpoints) happens before `start()`;
after it the set of streams and callbacks is fixed, so nothing can miss rows that
arrived before it was registered.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from plait.caches.cleanup import InvalidationCleanup
from plait.caches.invalidations import CACHES_STREAM, InvalidationRows, caches_stream_spec
from plait.caches.registry import CacheRegistry
from plait.caches.start import fenced
from plait.config import InstanceConfig, StreamConfig
from plait.core.commands import Command, CommandSet
from plait.errors import ConfigError, StateError
from plait.instance.http import start_api
from plait.instance.transport import Transport, make_transport
from plait.replication.handler import (
    CommandListener,
    DepartureListener,
    Listeners,
    PositionListener,
    ReplicationHandler,
    ResetListener,
    RowsListener,
)
from plait.replication.http_api import EndpointHandler
from plait.replication.http_client import InternalClient
from plait.replication.http_server import InternalApi
from plait.replication.metrics import ReplicationMetrics
from plait.replication.rows import DictRows, JsonRows, RowCodec
from plait.replication.streams import DatabaseStream, InMemoryStream, ReplicatedStream
from plait.replication.waiters import PositionWaiters
from plait.storage.database import Database
from plait.storage.incarnation import Incarnation
from plait.streams.generator import MultiWriterIdGenerator
from plait.streams.memory import MemoryStream, ReadPage
from plait.tasks import cancel_and_wait

logger = logging.getLogger("plait.instance")  # what operators filter on

DEFAULT_WAIT = 5.0  # seconds


class Instance:
    """One plait process; see the module docstring."""

    def __init__(self, config: InstanceConfig | Mapping[str, Any], *, db: Database | None = None):
        self.config = InstanceConfig.load(config)
        self.name = self.config.instance_name
        self._given_db = db
        self._db: Database | None = db
        self._codecs: dict[str, RowCodec[Any]] = {}
        self._listeners = Listeners()
        self._commands = CommandSet()
        self._endpoints: dict[str, EndpointHandler] = {}
        self._schema: list[str] = []
        self._streams: dict[str, ReplicatedStream] = {}
        self._generators: dict[str, MultiWriterIdGenerator] = {}
        self.metrics = ReplicationMetrics()
        self._waiters = PositionWaiters()
        self._handler: ReplicationHandler | None = None
        self._transport: Transport | None = None
        self._api: InternalApi | None = None
        self._client: InternalClient | None = None
        # Caches can be declared (`@instance.caches.cached()`) before start().
        self.caches = CacheRegistry(self.name, self.metrics)
        self._cleanup: asyncio.Task[None] | None = None
        self._retiring: asyncio.Task[None] | None = None  # replication ends: superseded
        self._started = False
        self._stopped = False

    @classmethod
    def from_yaml(cls, path: str | Path, *, db: Database | None = None) -> Instance:
        return cls(InstanceConfig.from_yaml(path), db=db)

    # -- registration (before start) ---------------------------------------------------------

    def row_type(self, stream: str, codec: RowCodec[Any]) -> None:
        """How rows of `stream` reach `on_rows` (default: dicts of JSON-safe columns)."""
        self._before_start("set a row type")
        self._stream_config(stream)
        self._codecs[stream] = codec

    def on_rows(self, stream: str, listener: RowsListener) -> None:
        """`listener(stream, writer, token, rows)` for rows other instances wrote, in
        order, each row once; `token` (signed) covers every row of `writer` up to it.
        An `async def` listener is awaited; a plain function is called synchronously
        (live rows then reach it without a task switch) and must not return a
        coroutine."""
        self._add_listener(self._listeners.rows, stream, listener)

    def on_position(self, stream: str, listener: PositionListener) -> None:
        """`listener(stream, writer, token)` whenever another writer's position moves."""
        self._add_listener(self._listeners.positions, stream, listener)

    def on_reset(self, stream: str, listener: ResetListener) -> None:
        """`listener(stream, writer)` when an in-memory stream's writer restarted: drop
        what you kept of it; its whole current state follows through `on_rows`."""
        self._add_listener(self._listeners.resets, stream, listener)

    def on_departure(self, listener: DepartureListener) -> None:
        """`listener(instance)` when another instance shuts down cleanly."""
        self._before_start("add a listener")
        self._listeners.departures.append(listener)

    def register_command(self, command: type[Command], listener: CommandListener) -> None:
        """An application command: peers' lines `NAME args` reach `listener(command)`,
        in the order received on each connection. Your own commands come back to you
        over Redis: tell them apart by an instance field of the command."""
        self._before_start("register a command")
        self._commands.register(command)
        self._listeners.commands[command.NAME] = listener

    def add_schema(self, statements: str) -> None:
        """Idempotent DDL the application's streams need (`CREATE TABLE IF NOT EXISTS
        ...`): run at start, once the database is up and before any stream opens (a
        stream checks its tables), under plait's migration lock."""
        self._before_start("add schema statements")
        self._schema.append(statements)

    def register_endpoint(self, name: str, handler: EndpointHandler) -> None:
        """An internal HTTP endpoint other instances reach with `call(...)`."""
        self._before_start("register an endpoint")
        if name in self._endpoints:
            raise ConfigError(f"endpoint {name!r} is registered already")
        self._endpoints[name] = handler

    # -- lifetime ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, load every stream, then start the HTTP API and replication."""
        if self._started:
            raise StateError(f"instance {self.name!r} was started already")
        self._started = True
        config = self.config
        try:
            if self._db is None:
                # Its connections carry this run's name, so that its writers can be
                # fenced should it die with IDs in flight. A server that is not up yet,
                # or restarts meanwhile, is waited for (`database_patience`): every
                # step below may run again.
                db = self._db = await Database.connect(
                    config.database,
                    incarnation=Incarnation.new(self.name),
                    timeouts=config.database_timeouts,
                    retry_reads_for=config.database_patience,
                    wait_for_server=config.database_patience,
                )
                await db.retry_idempotent("migrate plait's schema", db.migrate)
            self.db.on_superseded(self._superseded)
            for statements in self._schema:
                await self.db.retry_idempotent(
                    "create the application's schema (add_schema)",
                    functools.partial(self.db.run_schema, statements),
                )
            for stream_config in config.streams:
                self._streams[stream_config.name] = await self._open_stream(stream_config)
            if config.caches.enabled:
                await self._open_caches()
            if config.http.enabled:
                await self._start_http()
            if config.replication.transport != "none":
                await self._start_replication()
        except BaseException:
            await self.stop()
            raise
        logger.info("instance %s: started with streams %s", self.name, list(self._streams))

    async def stop(self) -> None:
        """Send what is left and announce departure, then close everything, in order."""
        if self._stopped:
            return
        self._stopped = True
        if self._cleanup is not None:
            await cancel_and_wait(self._cleanup)
        if self._retiring is not None:
            await self._retiring
        else:
            await self._stop_replication(depart=self._db is None or not self._db.superseded)
        if self._api is not None:
            await self._api.stop()
        if self._client is not None:
            await self._client.close()
        for gen in self._generators.values():
            await gen.close()
        if self._db is not None and self._given_db is None:
            await self._db.close()

    async def _stop_replication(self, *, depart: bool) -> None:
        if self._handler is not None:
            await self._handler.stop(depart=depart)
        if self._transport is not None:
            await self._transport.stop()

    def _superseded(self) -> None:
        """A later run of this instance registered: it speaks for the name now. This run
        stops replicating (without a DEPART, which would be taken as the live run's) and
        may write nothing more (`SupersededError`)."""
        logger.error(
            "instance %s: a later run of %s has started on the same database and "
            "superseded this one: this run stops replicating and can write nothing more; "
            "stop this process",
            self.name,
            self.name,
        )
        if self._retiring is None and not self._stopped:
            self._retiring = asyncio.get_running_loop().create_task(
                self._stop_replication(depart=False), name=f"plait-retire-{self.name}"
            )

    async def __aenter__(self) -> Instance:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- use --------------------------------------------------------------------------------------

    @property
    def db(self) -> Database:
        if self._db is None:
            raise StateError(f"instance {self.name!r} is not started")
        return self._db

    @property
    def http_url(self) -> str | None:
        """The internal HTTP API's base URL, once started."""
        return None if self._api is None else self._api.url

    def generator(self, stream: str) -> MultiWriterIdGenerator:
        gen = self._generators.get(stream)
        if gen is None:
            kind = self._stream_config(stream).kind
            raise ConfigError(
                f"stream {stream!r} has no ID generator here ({kind} stream, or the "
                "instance is not started)"
            )
        return gen

    def memory(self, stream: str) -> MemoryStream:
        """The in-memory stream this instance writes (`write(key, row)`)."""
        replicated = self._streams.get(stream)
        if not isinstance(replicated, InMemoryStream) or replicated.memory is None:
            raise ConfigError(
                f"instance {self.name!r} does not write an in-memory stream {stream!r} "
                "(check the stream's kind and writers, and that the instance is started)"
            )
        return replicated.memory

    def send_command(self, command: Command) -> None:
        """Send an application command to every peer."""
        if self._handler is not None:
            self._handler.send(command)

    async def wait_for_stream_position(
        self,
        instance: str,
        stream: str,
        position: int,
        timeout: float = DEFAULT_WAIT,  # noqa: ASYNC109 (R-RP-6)
    ) -> bool:
        """Whether this process has seen `instance` reach `position` on `stream` within
        `timeout` seconds (R-RP-6): True at once for ourselves or a position seen
        already; False, logged, on timeout. Released only after the rows' listeners ran
        and the stream advanced."""
        replicated = self._streams.get(stream)
        if replicated is None:
            raise ConfigError(f"unknown stream {stream!r}; streams here: {list(self._streams)}")
        if instance == self.name:
            return True
        return await self._waiters.wait(
            replicated, instance, position, timeout, metrics=self.metrics, waiter=self.name
        )

    async def call(
        self, instance: str, endpoint: str, args: Any = None, *, txn_id: str | None = None
    ) -> Any:
        """Call another instance's endpoint: it sees our writes before it runs, and we
        see its writes before this returns (R-RP-6). Retries reuse `txn_id`."""
        if self._client is None:
            raise ConfigError(f"instance {self.name!r} has no HTTP client (not started?)")
        return await self._client.call(instance, endpoint, args, txn_id=txn_id)

    def own_positions(self) -> dict[str, int]:
        """Signed positions of what this instance wrote, per stream it writes: what a
        peer must have seen to see every write that completed here (including writes
        that finished while an earlier one is still running: the peer then waits for
        that one too, as the stream's order demands)."""
        positions: dict[str, int] = {}
        for name, replicated in self._streams.items():
            if isinstance(replicated, DatabaseStream):
                gen = replicated.generator
                if gen.is_writer:
                    positions[name] = gen.get_last_completed_token()
            elif (position := replicated.own_position()) is not None:
                positions[name] = position
        return positions

    async def await_positions(
        self,
        instance: str,
        positions: Mapping[str, int],
        timeout: float = DEFAULT_WAIT,  # noqa: ASYNC109 (R-RP-6)
    ) -> None:
        """Wait until `instance`'s positions are seen, on every stream at once: `timeout`
        seconds at most in all, not per stream."""
        await asyncio.gather(
            *(
                self.wait_for_stream_position(instance, stream, position, timeout)
                for stream, position in positions.items()
                if stream in self._streams and isinstance(position, int)
            )
        )

    # -- internals -------------------------------------------------------------------------------

    def _add_listener(self, kind: dict[str, list[Any]], stream: str, listener: Any) -> None:
        self._before_start("add a listener")
        if not (stream == CACHES_STREAM and self.config.caches.enabled):
            self._stream_config(stream)
        kind.setdefault(stream, []).append(listener)

    def _before_start(self, what: str) -> None:
        if self._started:
            raise StateError(f"instance {self.name!r}: {what} before start(), not after")

    def _stream_config(self, stream: str) -> StreamConfig:
        for candidate in self.config.streams:
            if candidate.name == stream:
                return candidate
        known = [s.name for s in self.config.streams]
        raise ConfigError(f"unknown stream {stream!r}; configured streams: {known}")

    async def _open_stream(self, config: StreamConfig) -> ReplicatedStream:
        if config.kind == "memory":
            return InMemoryStream(
                config.name,
                self.name,
                frozenset(config.writers),
                self._codecs.get(config.name, JsonRows()),
                self._http_client,
            )
        replicated = self.config.replication.transport != "none"
        gen = await MultiWriterIdGenerator.create(
            self.db,
            config.to_spec(),
            self.name,
            position_flush_interval=self.config.position_flush_interval,
            # With replication, other writers' positions move only as their rows are
            # delivered; following the database as well would skip rows.
            follow_database=not replicated,
            fence_after=self.config.fence_after,
        )
        return self._database_stream(gen, self._codecs.get(config.name, DictRows()))

    def _database_stream(self, gen: MultiWriterIdGenerator, codec: RowCodec[Any]) -> DatabaseStream:
        self._generators[gen.stream_name] = gen
        stream = DatabaseStream(gen, codec, self.metrics)
        if self.config.replication.transport != "none" and gen.is_writer:
            stream.open_outbox()  # from the start: nothing is in flight yet
        return stream

    async def _open_caches(self) -> None:
        """The `caches` stream: every instance writes it; its rows reach the registry
        before any other listener, and before its position moves (R-CA-3)."""
        config = self.config
        gen = await self.db.retry_idempotent("start the caches stream", self._fenced_caches)
        self._streams[CACHES_STREAM] = self._database_stream(gen, InvalidationRows())
        self._listeners.rows.setdefault(CACHES_STREAM, []).insert(0, self.caches.on_rows)
        self.caches.bind(gen, self.db)
        if config.caches.cleanup:
            metrics = self.metrics
            cleanup = InvalidationCleanup(
                self.db,
                retention=config.caches.retention,
                batch=config.caches.cleanup_batch,
                interval=config.caches.cleanup_interval,
                pause=config.caches.cleanup_pause,
                on_deleted=metrics.invalidation_rows_deleted.inc,
            )
            self._cleanup = asyncio.create_task(cleanup.run(), name=f"plait-cleanup-{self.name}")

    async def _fenced_caches(self) -> MultiWriterIdGenerator:
        """The caches stream's generator, started under `fenced`'s lock; closed again
        when the lock's transaction fails after it started (the step is retried)."""
        made: list[MultiWriterIdGenerator] = []

        async def start() -> MultiWriterIdGenerator:
            made.append(await self._open_caches_generator())
            return made[-1]

        try:
            return await fenced(self.db, start)
        except BaseException:
            for gen in made:
                await gen.close()
            raise

    async def _open_caches_generator(self) -> MultiWriterIdGenerator:
        return await MultiWriterIdGenerator.create(
            self.db,
            caches_stream_spec(),
            self.name,
            position_flush_interval=self.config.position_flush_interval,
            follow_database=False,  # no position rows to follow (any-writer stream)
        )

    def _http_client(self) -> InternalClient:
        if self._client is None:
            raise ConfigError(f"instance {self.name!r}: the internal HTTP API is disabled")
        return self._client

    async def _catch_up_source(
        self, stream: str, from_exclusive: int, to_inclusive: int, limit: int
    ) -> ReadPage:
        replicated = self._streams.get(stream)
        if not isinstance(replicated, InMemoryStream):
            raise KeyError(stream)
        return replicated.read_json(from_exclusive, to_inclusive, limit)

    async def _start_http(self) -> None:
        self._api = await start_api(
            self.config,
            self._endpoints,
            catch_up=self._catch_up_source,
            own_positions=self.own_positions,
            await_positions=self.await_positions,
            metrics=self.metrics,
        )
        self._client = InternalClient(
            instance_name=self.name,
            instance_map=self.config.instance_map,
            secret=self.config.http.secret_value(),
            own_positions=self.own_positions,
            await_positions=self.await_positions,
        )

    async def _start_replication(self) -> None:
        config = self.config.replication
        self._handler = ReplicationHandler(
            self.name,
            self._streams,
            commands=self._commands,
            listeners=self._listeners,
            waiters=self._waiters,
            metrics=self.metrics,
            options=config,
        )
        self._transport = make_transport(self.config, self._handler, self.metrics)
        await self._handler.start()
        await self._transport.start()
