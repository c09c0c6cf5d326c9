"""The chat service's public HTTP API (`SyncWorker`, run by the `sync_worker` role):
writes forwarded to the instance that owns them, and `GET /sync`, a long-poll for a
user's rooms that waits for the writes a client made elsewhere (their `after` token)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from plait.core.tokens import StreamToken
from plait.demo import api_requests, presence, sharding, sync
from plait.demo.schema import MAIN
from plait.demo.shared import declare_shared, event_writers
from plait.demo.tokens import SyncToken, parse, resolve, writer_ids
from plait.errors import PlaitError
from plait.instance import Instance
from plait.streams.generator import MultiWriterIdGenerator

logger = logging.getLogger("plait.demo.roles")  # what operators filter on

# Public writes whose answer carries an `after` token, by the stream they write.
_WRITES_TO = {
    "send_message": "events",
    "set_membership": "events",
    "set_account_data": "account_data",
    "set_tag": "account_data",
}
MAX_TIMEOUT_MS = 30_000


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
