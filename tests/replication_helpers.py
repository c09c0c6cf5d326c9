"""Instances of one deployment inside one test: shared database, real Redis or TCP."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql

import pace
from plait import Database
from plait.instance import Instance
from plait.ports import free_port
from plait.storage.stream_tables import StreamRow

EVENTS = {
    "name": "events",
    "tables": [{"name": "events"}, {"name": "events_extra"}],
    "writers": ["w1", "w2"],
}
TYPING = {"name": "typing", "kind": "memory", "writers": ["w1"]}
NOTES = {"name": "notes", "tables": [{"name": "notes"}], "writers": ["w1", "w2"]}
STREAMS = [EVENTS, TYPING, NOTES]


class TableRows:
    """Rows as (table, stream_id, writer, body), whether they came live or from the
    database: both tables of a stream stay apart."""

    def from_db(self, row: StreamRow) -> tuple[str, int, str, str]:
        return (row.table, row.stream_id, row.instance_name, row.data["payload"])

    def to_json(self, row: tuple[str, int, str, str]) -> Any:
        return list(row)

    def from_json(self, value: Any) -> tuple[str, int, str, str]:
        table, stream_id, writer, body = value
        return (table, stream_id, writer, body)


@dataclass
class Seen:
    """What one instance's `on_rows` got, call by call."""

    calls: list[tuple[str, int, list[Any]]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def on_rows(self, stream: str, writer: str, token: int, rows: list[Any]) -> None:
        self.calls.append((writer, token, rows))
        self.changed.set()

    @property
    def rows(self) -> list[Any]:
        return [row for _, _, rows in self.calls for row in rows]

    async def wait(self, count: int, within: float = 15.0) -> None:
        """Until `count` rows arrived, for `within` seconds at this machine's pace."""
        try:
            async with pace.within(within, f"{count} rows"):
                while len(self.rows) < count:
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError as late:
            raise TimeoutError(f"{late}; {len(self.rows)} arrived") from None


def metric(instance: Instance, name: str, **labels: str) -> float:
    """A sample of `instance`'s metrics, as a scrape would read it (0 when absent)."""
    value = instance.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def start_connected(
    cluster: Cluster, seen: Mapping[str, Any], **overrides: Any
) -> list[Instance]:
    """An instance of `cluster` for each name in `seen` (with `overrides` to its config),
    giving the rows it receives to its `Seen`; returns once all are connected."""
    instances = []
    for name, rows in seen.items():
        instance = cluster.instance(name, **overrides)
        instance.on_rows("events", rows.on_rows)
        instances.append(await cluster.start(instance))
    await connected(*instances)
    return instances


async def connected(*instances: Instance) -> None:
    """Until every instance's connections are up (every stream caught up)."""
    await pace.until(
        lambda: all(_up(i) for i in instances), 10, "every instance's connections to be up"
    )


def _up(instance: Instance) -> bool:
    text = instance.metrics.render().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("plait_connection_up{")]
    return bool(lines) and all(ln.endswith(" 1.0") for ln in lines)


@contextlib.asynccontextmanager
async def cluster_of(db: Database, transport: str, **kwargs: Any) -> AsyncIterator[Cluster]:
    """A `Cluster` on freshly created stream tables; its instances stop at the end."""
    await create_tables(db)
    cluster = Cluster(db, transport, **kwargs)
    try:
        yield cluster
    finally:
        await cluster.close()


async def create_tables(db: Database) -> None:
    async with db.connection() as conn:
        for table in ("events", "events_extra"):
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE {t} (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
                    " payload TEXT); CREATE INDEX ON {t} (instance_name, stream_id);"
                    " CREATE INDEX ON {t} (stream_id)"
                ).format(t=sql.Identifier(table))
            )
        await conn.execute(
            "CREATE TABLE notes (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
            " body TEXT, at TIMESTAMPTZ NOT NULL DEFAULT now(), amount NUMERIC);"
            " CREATE INDEX ON notes (instance_name, stream_id)"
        )


async def write(instance: Instance, body: str, *, rows: int = 1, both_tables: bool = False) -> int:
    """One stream ID with `rows` rows in `events` (and as many in `events_extra`)."""
    gen = instance.generator("events")
    async with gen.get_next() as stream_id, instance.db.transaction() as txn:
        for i in range(rows):
            for table in ("events", "events_extra") if both_tables else ("events",):
                await txn.execute(
                    sql.SQL("INSERT INTO {} VALUES (%s, %s, %s)").format(sql.Identifier(table)),
                    (stream_id, instance.name, f"{body}.{i}"),
                )
    return stream_id


async def write_many(instance: Instance, count: int, prefix: str) -> list[int]:
    """`count` rows, one per ID, in one statement per 100."""
    ids: list[int] = []
    gen = instance.generator("events")
    for start in range(0, count, 100):
        n = min(100, count - start)
        ids += await gen.insert(
            "INSERT INTO events SELECT {id}, %s, %s || g FROM generate_series(%s::int, %s::int) g"
            " RETURNING stream_id",
            (instance.name, prefix, start, start + n - 1),
        )
    return ids


class Cluster:
    """Configs for the instances of one test: one deployment (Redis channel), fixed
    HTTP ports (so a restarted instance keeps its address), one database."""

    def __init__(
        self,
        db: Database,
        transport: str,
        *,
        redis_url: str = "",
        hub: str = "w1",
        catch_up_page_max: int = 10_000,
    ) -> None:
        self.db = db
        self.transport = transport
        self.redis_url = redis_url
        self.hub = hub
        self.catch_up_page_max = catch_up_page_max
        self.deployment = f"t{uuid.uuid4().hex[:10]}"
        self.hub_port = free_port()
        self.ports: dict[str, int] = {name: free_port() for name in ("w1", "w2", "r", "hub")}
        self.instances: list[Instance] = []

    def config(self, name: str, **overrides: Any) -> dict[str, Any]:
        for other in ("w1", "w2", "r", "hub", name):
            self.ports.setdefault(other, free_port())
        replication: dict[str, Any] = {
            "transport": self.transport,
            "announce_interval": 0.2,
            "catch_up_page": 100,
            "catch_up_page_max": self.catch_up_page_max,
            "backoff_initial": 0.05,
            "backoff_cap": 1.0,
        }
        if self.transport == "redis":
            replication["redis"] = {"url": self.redis_url}
        elif self.transport == "tcp":
            replication["tcp"] = {"hub": self.hub, "port": self.hub_port}
        replication.update(overrides.pop("replication", {}))
        config: dict[str, Any] = {
            "instance_name": name,
            "deployment": self.deployment,
            "streams": STREAMS,
            "instance_map": {n: f"http://127.0.0.1:{p}" for n, p in self.ports.items()},
            "replication": replication,
            "http": {"port": self.ports[name]},
            "position_flush_interval": 0.2,
        }
        config.update(overrides)
        return config

    def instance(self, name: str, **overrides: Any) -> Instance:
        instance = Instance(self.config(name, **overrides), db=self.db)
        instance.row_type("events", TableRows())
        return instance

    async def start(self, instance: Instance) -> Instance:
        await instance.start()
        self.instances.append(instance)
        return instance

    async def close(self) -> None:
        for instance in reversed(self.instances):
            await instance.stop()
