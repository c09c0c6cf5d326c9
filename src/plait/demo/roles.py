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
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from psycopg import sql
from psycopg.types.json import Jsonb

from plait.caches.cached import CachedFunction
from plait.core.tokens import StreamToken
from plait.demo import api_requests, presence, sharding, sync
from plait.demo.schema import MAIN
from plait.demo.tokens import SyncToken, parse, resolve, writer_ids
from plait.errors import ConfigError, PlaitError
from plait.instance import Instance
from plait.streams.generator import MultiWriterIdGenerator

logger = logging.getLogger(__name__)

SYNC_PORT_ENV = "PLAIT_DEMO_SYNC_PORT"
# Public writes whose answer carries an `after` token, by the stream they write.
_WRITES_TO = {
    "send_message": "events",
    "set_membership": "events",
    "set_account_data": "account_data",
    "set_tag": "account_data",
}
ROOM_CHANGED = "room_changed"
MAX_TIMEOUT_MS = 30_000


@dataclass(frozen=True, slots=True)
class Caches:
    room_members: CachedFunction[[str], list[str]]
    rooms_for_user: CachedFunction[[str], list[str]]


def declare_shared(instance: Instance, on_presence: Callable[[Any], None] | None = None) -> Caches:
    """What every process of the service declares: the presence commands (every peer
    must know them: the hub relays them to all) and the caches."""
    listener = on_presence or (lambda command: None)
    instance.register_command(presence.UserSync, listener)
    instance.register_command(presence.ClearUserSync, listener)
    return declare_caches(instance)


def declare_caches(instance: Instance) -> Caches:
    """The caches every process has; one room change invalidates the member list and
    each member's entries everywhere, in one row (`invalidate_batch`)."""

    async def joined(column: str, where: str, value: str) -> list[str]:
        """`column` of the joined memberships whose `where` is `value`."""
        query = sql.SQL(
            "SELECT {c} FROM current_members WHERE {w} = %s AND membership = 'join' ORDER BY 1"
        ).format(c=sql.Identifier(column), w=sql.Identifier(where))
        async with instance.db.connection() as conn:
            cursor = await conn.execute(query, (value,))
            return [found for (found,) in await cursor.fetchall()]

    @instance.caches.cached(name="room_members")
    async def room_members(room_id: str) -> list[str]:
        return await joined("user_id", "room_id", room_id)

    @instance.caches.cached(name="rooms_for_user")
    async def rooms_for_user(user_id: str) -> list[str]:
        return await joined("room_id", "user_id", user_id)

    @instance.caches.pseudo_cache(ROOM_CHANGED)
    def room_changed(room_id: str, users: tuple[str, ...]) -> Iterator[tuple[str, tuple[str]]]:
        yield (room_members.name, (room_id,))
        for user in users:
            yield (rooms_for_user.name, (user,))

    return Caches(room_members, rooms_for_user)


def event_writers(instance: Instance) -> list[str]:
    for stream in instance.config.streams:
        if stream.name == "events":
            return list(stream.writers)
    raise ConfigError("the chat service needs an 'events' stream in the configuration")


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


class SyncWorker:
    """The public HTTP API of one sync worker."""

    def __init__(
        self, instance: Instance, port: int = 0, host: str = "127.0.0.1", linger: float = 5.0
    ) -> None:
        self.instance = instance
        self.caches = declare_shared(instance)
        # A user counts as syncing this long after their last sync ended, so a client
        # that long-polls back to back does not flap between online and offline.
        self.linger = linger
        self._ending: dict[str, asyncio.Task[None]] = {}
        self._closing = False
        self.writers = event_writers(instance)
        self.notifier = sync.Notifier()
        self.syncing = presence.Local()
        self.host, self.port = host, port
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        # The latest typing notice of each room, as the typing writer sent it.
        self.typing: dict[str, tuple[int, list[str]]] = {}
        for stream in ("events", "account_data"):
            instance.on_rows(stream, self._rows)
        instance.on_rows("typing", self._typing)
        instance.on_reset("typing", self._typing_reset)

    async def _rows(self, stream: str, writer: str, token: int, rows: list[Any]) -> None:
        await self.notifier.notify()

    async def _typing(self, stream: str, writer: str, token: int, rows: list[Any]) -> None:
        for row in rows:
            self.typing[str(row["room"])] = (token, list(row["users"]))
        await self.notifier.notify()

    def _typing_position(self) -> int:
        """The typing stream's position as far as this worker has it."""
        return max((token for token, _ in self.typing.values()), default=0)

    async def _typing_reset(self, stream: str, writer: str) -> None:
        self.typing.clear()  # the writer restarted: its whole state follows

    async def start(self) -> None:
        app = web.Application()
        app.add_routes(
            [
                web.post("/send", self._forward("send_message")),
                web.post("/membership", self._forward("set_membership")),
                web.post("/account_data", self._forward("set_account_data", MAIN)),
                web.post("/tags", self._forward("set_tag", MAIN)),
                web.post("/typing", self._forward("set_typing", MAIN)),
                web.post("/backfill", self._forward("backfill", MAIN)),
                web.get("/backfill", self._backfilled),
                web.get("/sync", self._sync),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{bound[0]}:{bound[1]}"
        logger.info("sync worker %s: public API at %s", self.instance.name, self.url)

    async def stop(self) -> None:
        """Stop serving, then tell the presence writer every user here stopped syncing
        (before the instance stops: it sends what is left, then departs)."""
        if self._runner is not None:
            self._closing = True  # long-polls in flight answer now; new syncs are refused
            await self.notifier.notify()
            await self._runner.cleanup()
            self._runner = None
            for task in self._ending.values():
                task.cancel()
            self._ending.clear()
            self.instance.send_command(presence.ClearUserSync(self.instance.name))

    async def _end_later(self, user: str) -> None:
        await asyncio.sleep(self.linger)
        self._ending.pop(user, None)
        self._presence(user, "end")

    def _presence(self, user: str, state: str) -> None:
        ms = int(time.time() * 1000)
        self.instance.send_command(presence.UserSync(self.instance.name, user, state, ms))

    def _forward(
        self, endpoint: str, to: str | None = None
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        """A public write, run by the instance that owns it: `to`, or the room's writer."""

        async def handle(request: web.Request) -> web.Response:
            try:
                body = api_requests.body(endpoint, await request.read())
            except api_requests.BadRequest as err:
                return web.json_response({"error": f"bad request: {err}"}, status=400)
            try:
                owner = to or sharding.owner(body["room"], self.writers)
                answer = await self.instance.call(owner, endpoint, body)
            except PlaitError as err:
                return web.json_response({"error": str(err)}, status=502)
            after = await self._after(endpoint, owner, answer)
            return web.json_response({**answer, **({"after": after} if after else {})})

        return handle

    async def _sync(self, request: web.Request) -> web.Response:
        user = request.query.get("user", "")
        if self._closing:
            return web.json_response({"error": "this sync worker is stopping"}, status=503)
        if not user:
            return web.json_response({"error": "user is required"}, status=400)
        try:
            presence.check_user(user)
            timeout_ms = _milliseconds(request.query.get("timeout", "0"))
            if "after" in request.query:
                await self._wait_after(request.query["after"])
            since = await self._since(request.query.get("since"))
        except (ValueError, PlaitError) as err:
            return web.json_response({"error": str(err)}, status=400)
        deadline = time.monotonic() + timeout_ms / 1000
        ending = self._ending.pop(user, None)
        if self.syncing.begin(user) and ending is None:
            self._presence(user, "start")
        elif ending is not None:
            ending.cancel()  # back within the linger: still syncing, nothing to say
        try:
            while True:
                generation = self.notifier.generation
                answer, token = await self._changes(user, since)
                left = deadline - time.monotonic()
                if any(answer.values()) or left <= 0 or self._closing:
                    break
                await self.notifier.wait_past(generation, left)
        finally:
            if self.syncing.end(user):
                self._ending[user] = asyncio.create_task(self._end_later(user))
        ids = await self.instance.db.get_instance_ids(
            sorted(set(token.events.writers) | set(token.account_data.writers))
        )
        return web.json_response({"next": token.encode(ids), **answer})

    async def _changes(self, user: str, since: SyncToken) -> tuple[dict[str, Any], SyncToken]:
        """What changed for `user` after `since`, and the token after it."""
        db = self.instance.db
        rooms = await self.caches.rooms_for_user(user)
        events_gen = self.instance.generator("events")
        now = since.events.copy_and_advance(StreamToken.from_generator(events_gen))
        events = await sync.rows_between(db, events_gen.spec, "room_id", rooms, since.events, now)
        data_gen = self.instance.generator("account_data")
        now = since.account_data.copy_and_advance(StreamToken.from_generator(data_gen))
        data = await sync.rows_between(
            db, data_gen.spec, "user_id", [user], since.account_data, now
        )
        typing_at = max(since.typing, self._typing_position())
        typing = {
            room: users
            for room, (token, users) in self.typing.items()
            if token > since.typing and room in rooms
        }
        answer = {"events": events.rows, "account_data": data.rows, "typing": typing}
        return answer, SyncToken(events.token, data.token, typing_at)

    async def _after(self, endpoint: str, owner: str, answer: Any) -> str | None:
        """A sync token naming just this write: `GET /sync?after=` it, on any sync
        worker, answers only once that worker has seen the write (read-your-writes
        across workers)."""
        stream = _WRITES_TO.get(endpoint)
        if stream is None:
            return None
        wrote = StreamToken(0, {owner: int(answer["stream_id"])})
        token = SyncToken(
            wrote if stream == "events" else StreamToken(0),
            wrote if stream == "account_data" else StreamToken(0),
            0,
        )
        return token.encode(await self.instance.db.get_instance_ids([owner]))

    async def _resolve(self, text: str) -> SyncToken:
        """A sync token's text, with its writers' compact ids turned into names."""
        parsed = parse(text)
        return resolve(
            parsed, await self.instance.db.get_instance_names(sorted(writer_ids(parsed)))
        )

    async def _wait_after(self, text: str) -> None:
        """Until this worker has seen every write `text` (an `after` token) names."""
        token = await self._resolve(text)
        # A position beyond what the sequences handed out (a token from the future) is
        # clamped (R-TK-2), and the waits run together: a bad token costs at most one
        # wait timeout, not one per writer it names.
        events_gen = self.instance.generator("events")
        data_gen = self.instance.generator("account_data")
        token = token.clamp(
            await _head(token.events, events_gen), await _head(token.account_data, data_gen), 0
        )
        await asyncio.gather(
            *(
                self.instance.wait_for_stream_position(writer, stream, position)
                for stream, part in (("events", token.events), ("account_data", token.account_data))
                for writer, position in part.writers.items()
            )
        )

    async def _backfilled(self, request: web.Request) -> web.Response:
        """`GET /backfill?room=R&since=TOKEN`: history imported into a room after
        `since` (a token of the `backfill` stream; none: from the start), newest import
        first, and the token to ask from next."""
        gen = self.instance.generator("backfill")
        try:
            room = api_requests.identifier(request.query.get("room", ""), "room")
            since = (
                StreamToken(0)
                if "since" not in request.query
                else (await StreamToken.parse(self.instance.db, request.query["since"]))
            )
        except (api_requests.BadRequest, PlaitError) as err:
            return web.json_response({"error": str(err)}, status=400)
        now = since.copy_and_advance(StreamToken.from_generator(gen))
        page = await sync.rows_between(self.instance.db, gen.spec, "room_id", [room], since, now)
        return web.json_response(
            {"next": await page.token.to_string(self.instance.db), "events": page.rows}
        )

    async def _since(self, text: str | None) -> SyncToken:
        """The client's token, clamped to what exists; none: from now."""
        events_gen = self.instance.generator("events")
        data_gen = self.instance.generator("account_data")
        typing_now = self._typing_position()
        if text is None:
            return SyncToken(
                StreamToken.from_generator(events_gen),
                StreamToken.from_generator(data_gen),
                typing_now,
            )
        token = await self._resolve(text)
        return token.clamp(
            await _head(token.events, events_gen),
            await _head(token.account_data, data_gen),
            typing_now,
        )


def _milliseconds(text: str) -> int:
    """A long-poll timeout: digits, capped at `MAX_TIMEOUT_MS`; `ValueError` otherwise."""
    if not (text.isascii() and text.isdigit() and len(text) <= 12):
        raise ValueError(f"timeout must be a number of milliseconds, not {text[:20]!r}")
    return min(int(text), MAX_TIMEOUT_MS)


async def _head(part: StreamToken, gen: MultiWriterIdGenerator) -> int:
    """What to clamp a token's `part` to: the sequence head when it is ahead of what this
    process has seen (a token from the future), read only then."""
    if part.is_before_or_eq(StreamToken.from_generator(gen)):
        return part.max  # clamping to its own largest position changes nothing
    return await gen.get_max_allocated_token()


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
