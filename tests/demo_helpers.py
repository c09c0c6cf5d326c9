"""The reference chat deployment in one process, and posting JSON to its public API."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from plait import Database
from plait.demo import roles, schema
from plait.demo.roles import event_writer
from plait.demo.sync_api import SyncWorker
from plait.instance import Instance
from plait.ports import free_port

WRITERS = ["ev1", "ev2"]


@dataclass
class Chat:
    url: str  # the sync worker's public API
    url2: str  # the other sync worker's
    main: Instance
    sync1: Instance
    worker: SyncWorker
    instance: Callable[[str], Instance]  # another process of the deployment


@contextlib.asynccontextmanager
async def deployment(
    db: Database, linger: float = 5.0, sync2_lag: float = 0.0
) -> AsyncIterator[Chat]:
    """The deployment. `sync2_lag`: sync2 takes this long over each batch of events
    (a slow listener holds its queue for the stream), so it falls behind sync1."""
    async with db.connection() as conn:
        await conn.execute(schema.TABLES)
    names = ["main", *WRITERS, "sync1", "sync2"]
    ports = {name: free_port() for name in [*names, "bg"]}
    hub_port = free_port()

    def instance(name: str) -> Instance:
        config = schema.config(
            name,
            database=db.dsn,
            event_writers=WRITERS,
            http_ports=ports,
            secret="demo-secret",
            hub_port=hub_port,
        )
        return Instance(config)

    main = instance("main")
    roles.main(main)
    writers = [instance(name) for name in WRITERS]
    for writer in writers:
        event_writer(writer)
    sync1, sync2 = instance("sync1"), instance("sync2")
    if sync2_lag:

        async def slow(stream: str, writer: str, token: int, rows: list[Any]) -> None:
            await asyncio.sleep(sync2_lag)

        sync2.on_rows("events", slow)
    worker, worker2 = SyncWorker(sync1, linger=linger), SyncWorker(sync2, linger=linger)
    async with contextlib.AsyncExitStack() as stack:
        for one in (main, *writers, sync1, sync2):
            await stack.enter_async_context(one)
        for sync_worker in (worker, worker2):
            await sync_worker.start()
            stack.push_async_callback(sync_worker.stop)
        assert worker.url is not None
        assert worker2.url is not None
        yield Chat(worker.url, worker2.url, main, sync1, worker, instance)


@contextlib.asynccontextmanager
async def chat(db: Database) -> AsyncIterator[str]:
    """The deployment; yields the sync worker's public URL."""
    async with deployment(db) as running:
        yield running.url


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()
