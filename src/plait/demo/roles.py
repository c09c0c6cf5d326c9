"""The chat service's roles: each is a function of an `Instance`, called before it
starts, that registers what that process does (`plait serve --app
plait.demo.roles:event_writer`, and so on).

- `event_writer`: owns the rooms `sharding.owner` gives it; writes messages and
  membership changes (with the current state and one batched cache invalidation, in
  one transaction) when another process asks over the internal HTTP API.
- `main`: writes account data (three tables, one stream), typing notices (an
  in-memory stream) and imported history (`backfill`, a backwards stream).
- `background` (`Memberships`): follows `events` linearly and keeps
  `room_memberships` from the membership changes alone.
- `sync_worker`: the public HTTP API: `POST /send`, `/membership`, `/account_data`,
  `/tags`, `/typing` (forwarded to the instance that owns the write; the answer comes
  once this worker has seen it; its `after` token makes `GET /sync?after=` on any
  other worker wait for it too), and `GET /sync?user=U&since=TOKEN&timeout=MS`, a
  long-poll for the user's rooms: events, account data and typing notices. It tells
  `main` who is syncing (USER_SYNC) and clears them all when it stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from psycopg.types.json import Jsonb

from plait.demo import presence, sharding, sync
from plait.demo.shared import ROOM_CHANGED, declare_shared, event_writers
from plait.demo.sync_api import SyncWorker
from plait.errors import ConfigError
from plait.instance import Instance

logger = logging.getLogger(__name__)

SYNC_PORT_ENV = "PLAIT_DEMO_SYNC_PORT"


def event_writer(instance: Instance) -> None:
    declare_shared(instance)
    writers = event_writers(instance)

    def owned(args: Any) -> str:
        room = str(args["room"])
        if sharding.owner(room, writers) != instance.name:
            raise ConfigError(f"room {room!r} belongs to {sharding.owner(room, writers)}")
        return room

    async def send_message(args: Any) -> Any:
        room = owned(args)
        ids = await instance.generator("events").insert(
            "INSERT INTO events (stream_id, instance_name, room_id, sender, body)"
            " VALUES ({id}, %s, %s, %s, %s) RETURNING stream_id",
            (instance.name, room, str(args["sender"]), str(args["body"])),
        )
        return {"stream_id": ids[0]}

    async def set_membership(args: Any) -> Any:
        room, user, membership = owned(args), str(args["user"]), str(args["membership"])
        if membership not in ("join", "leave"):
            raise ConfigError(f"membership must be join or leave, not {membership!r}")
        async with instance.db.transaction() as txn:
            stream_id = await instance.generator("events").get_next_txn(txn)
            await txn.execute(
                "INSERT INTO room_state (stream_id, instance_name, room_id, user_id, membership)"
                " VALUES (%s, %s, %s, %s, %s)",
                (stream_id, instance.name, room, user, membership),
            )
            await txn.execute(
                "INSERT INTO current_members (room_id, user_id, membership) VALUES (%s, %s, %s)"
                " ON CONFLICT (room_id, user_id) DO UPDATE SET membership = EXCLUDED.membership",
                (room, user, membership),
            )
            cursor = await txn.execute(
                "SELECT user_id FROM current_members WHERE room_id = %s ORDER BY user_id", (room,)
            )
            users = [member for (member,) in await cursor.fetchall()]
            await instance.caches.invalidate_batch(txn, ROOM_CHANGED, (room,), users)
        return {"stream_id": stream_id}

    instance.register_endpoint("send_message", send_message)
    instance.register_endpoint("set_membership", set_membership)


def main(instance: Instance) -> None:
    """The hub process: writer of account data and typing notices, and the presence
    writer: who syncs where, from the sync workers' USER_SYNC commands (endpoint
    `online`)."""
    syncing = presence.Syncing()
    declare_shared(instance, syncing.apply)
    typing: dict[str, set[str]] = {}

    async def set_account_data(args: Any) -> Any:
        user, kind, content = str(args["user"]), str(args["kind"]), args["content"]
        room = args.get("room")
        gen = instance.generator("account_data")
        if room is None:
            query = (
                "INSERT INTO global_account_data (stream_id, instance_name, user_id, kind,"
                " content) VALUES ({id}, %s, %s, %s, %s) RETURNING stream_id"
            )
            params: tuple[Any, ...] = (instance.name, user, kind, Jsonb(content))
        else:
            query = (
                "INSERT INTO room_account_data (stream_id, instance_name, user_id, room_id,"
                " kind, content) VALUES ({id}, %s, %s, %s, %s, %s) RETURNING stream_id"
            )
            params = (instance.name, user, str(room), kind, Jsonb(content))
        return {"stream_id": (await gen.insert(query, params))[0]}

    async def set_tag(args: Any) -> Any:
        ids = await instance.generator("account_data").insert(
            "INSERT INTO room_tags (stream_id, instance_name, user_id, room_id, tag, content)"
            " VALUES ({id}, %s, %s, %s, %s, %s) RETURNING stream_id",
            (
                instance.name,
                str(args["user"]),
                str(args["room"]),
                str(args["tag"]),
                Jsonb(args.get("content", {})),
            ),
        )
        return {"stream_id": ids[0]}

    async def set_typing(args: Any) -> Any:
        room, user = str(args["room"]), str(args["user"])
        users = typing.setdefault(room, set())
        if args.get("typing", True):
            users.add(user)
        else:
            users.discard(user)
        token = instance.memory("typing").write(room, {"room": room, "users": sorted(users)})
        return {"token": token}

    async def backfill(args: Any) -> Any:
        """Older history: the `backfill` stream counts down (-1, -2, ...)."""
        ids = await instance.generator("backfill").insert(
            "INSERT INTO backfill_events (stream_id, instance_name, room_id, sender, body)"
            " VALUES ({id}, %s, %s, %s, %s) RETURNING stream_id",
            (instance.name, str(args["room"]), str(args["sender"]), str(args["body"])),
        )
        return {"stream_id": ids[0]}

    async def online(args: Any) -> Any:
        return {"online": sorted(syncing.online())}

    instance.on_departure(lambda name: syncing.apply(presence.ClearUserSync(name)))
    instance.register_endpoint("set_account_data", set_account_data)
    instance.register_endpoint("set_tag", set_tag)
    instance.register_endpoint("set_typing", set_typing)
    instance.register_endpoint("online", online)
    instance.register_endpoint("backfill", backfill)


def sync_worker(instance: Instance, port: int | None = None) -> Callable[[], Awaitable[None]]:
    """`plait serve --app plait.demo.roles:sync_worker`: the public API runs once the
    instance is up, until it stops, on `port` (default: $PLAIT_DEMO_SYNC_PORT, else any
    free port)."""
    if port is None:
        port = int(os.environ.get(SYNC_PORT_ENV, "0"))
    worker = SyncWorker(instance, port)

    async def run() -> None:
        await worker.start()
        try:
            await asyncio.Event().wait()
        finally:
            await worker.stop()

    return run


class Memberships:
    """The background worker: follows `events` linearly (every row at or below the
    stream's persisted-up-to position, in ID order) and keeps `room_memberships`, with
    its progress in the same transaction."""

    NAME = "memberships"

    def __init__(self, instance: Instance, page: int = 1000) -> None:
        self.instance = instance
        self.page = page
        self.position = 0
        self.notifier = sync.Notifier()
        declare_shared(instance)
        # After every delivery, with rows or without, once the position moved.
        instance.on_position("events", self._moved)

    async def _moved(self, stream: str, writer: str, token: int) -> None:
        await self.notifier.notify()

    async def run(self) -> None:
        async with self.instance.db.connection() as conn:
            cursor = await conn.execute(
                "SELECT stream_id FROM worker_progress WHERE worker = %s", (self.NAME,)
            )
            row = await cursor.fetchone()
        self.position = 0 if row is None else int(row[0])
        while True:
            generation = self.notifier.generation
            await self.catch_up()
            await self.notifier.wait_past(generation, 1.0)  # or look again in a second

    async def catch_up(self) -> None:
        """Apply every row up to the linear position as it is now."""
        gen = self.instance.generator("events")
        target = gen.get_persisted_upto_position()
        while self.position < target:
            rows, upto, _ = await gen.get_updates_since(None, self.position, target, self.page)
            changes = [
                (r.data["user_id"], r.data["room_id"], r.data["membership"], r.stream_id)
                for r in rows
                if r.table == "room_state"
            ]
            async with self.instance.db.transaction() as txn:
                if changes:  # one pipelined round trip for the page
                    await txn.executemany(
                        "INSERT INTO room_memberships (user_id, room_id, membership, stream_id)"
                        " VALUES (%s, %s, %s, %s) ON CONFLICT (user_id, room_id) DO UPDATE"
                        " SET membership = EXCLUDED.membership, stream_id = EXCLUDED.stream_id"
                        " WHERE room_memberships.stream_id < EXCLUDED.stream_id",
                        changes,
                    )
                await txn.execute(
                    "INSERT INTO worker_progress (worker, stream_id) VALUES (%s, %s)"
                    " ON CONFLICT (worker) DO UPDATE SET stream_id = EXCLUDED.stream_id",
                    (self.NAME, upto),
                )
            self.position = upto


def background(instance: Instance) -> Callable[[], Awaitable[None]]:
    """`plait serve --app plait.demo.roles:background`."""
    return Memberships(instance).run
