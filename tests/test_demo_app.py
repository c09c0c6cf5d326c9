"""The reference chat service in one process: a hub, two event writers and a sync
worker over TCP, through the sync worker's public HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

import pace
from demo_helpers import WRITERS, Chat, chat, deployment, post
from pace import scaled
from plait import Database
from plait.demo import schema, sharding
from plait.demo.roles import Memberships


def rooms_of(writer: str, count: int) -> list[str]:
    found = (f"!room{i}:demo" for i in range(1000))
    return [r for r in found if sharding.owner(r, WRITERS) == writer][:count]


def client() -> aiohttp.ClientSession:
    """A client whose request that hangs fails, with its URL, well before the test's
    timeout (aiohttp's own is 5 min, as long as the test's: a hang then showed no
    more than the test's timeout). 60 s at this machine's pace."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=scaled(60)))


async def sync(
    session: aiohttp.ClientSession, url: str, user: str, since: str | None = None, wait_ms: int = 0
) -> tuple[int, Any]:
    query = {"user": user, "timeout": str(wait_ms)}
    if since is not None:
        query["since"] = since
    try:
        async with session.get(f"{url}/sync", params=query) as response:
            return response.status, await response.json()
    except TimeoutError:
        raise AssertionError(
            f"waited {session.timeout.total or 0:.1f} s for an answer to GET /sync {query}"
        ) from None


async def test_sync_sees_messages_at_once_and_long_polls_for_new_ones(db: Database) -> None:
    r1, r2 = rooms_of("ev1", 1)[0], rooms_of("ev2", 1)[0]
    async with chat(db) as url, client() as session:
        for room in (r1, r2):
            for user in ("alice", "bob"):
                await post(
                    session, f"{url}/membership", {"room": room, "user": user, "membership": "join"}
                )
        status, first = await sync(session, url, "alice")
        assert status == 200
        assert first["events"] == []
        since = first["next"]

        # Read-your-writes: a message sent through this worker is in the very next sync,
        # whichever writer owns the room.
        for room in (r1, r2):
            sent = await post(session, f"{url}/send", {"room": room, "sender": "bob", "body": room})
            status, got = await sync(session, url, "alice", since)
            assert status == 200
            assert [(e["stream_id"], e["body"]) for e in got["events"]] == [
                (sent["stream_id"], room)
            ]
            since = got["next"]

        # A long-poll returns as soon as a message arrives, not at its timeout.
        waiting = asyncio.create_task(sync(session, url, "alice", since, wait_ms=20_000))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        started = time.monotonic()
        await post(session, f"{url}/send", {"room": r2, "sender": "bob", "body": "late"})
        status, got = await pace.wait(waiting, 10, "the long-poll to answer with the message")
        assert [e["body"] for e in got["events"]] == ["late"]
        # At once, not at the long-poll's 20 s timeout.
        assert time.monotonic() - started < min(pace.scaled(5), 15)
        since = got["next"]

        # Nothing new: an empty answer at the timeout, with the same position.
        status, got = await sync(session, url, "alice", since, wait_ms=200)
        assert (status, got["events"]) == (200, [])

        # Leaving a room: the membership change invalidates alice's room list on the
        # sync worker (one batched invalidation), so that room's messages stop.
        await post(
            session, f"{url}/membership", {"room": r1, "user": "alice", "membership": "leave"}
        )
        await post(session, f"{url}/send", {"room": r1, "sender": "bob", "body": "not for alice"})
        await post(session, f"{url}/send", {"room": r2, "sender": "bob", "body": "for alice"})
        status, got = await sync(session, url, "alice", since)
        bodies = [e["body"] for e in got["events"] if e["table"] == "events"]
        assert bodies == ["for alice"]


async def test_bad_and_future_tokens(db: Database) -> None:
    async with chat(db) as url, client() as session:
        status, got = await sync(session, url, "alice", "s5_nonsense")
        assert status == 400
        assert "3 parts" in got["error"]
        status, got = await sync(session, url, "alice", "m1~77.9_s0_t0")
        assert status == 400
        assert "instance id 77" in got["error"]
        # A user id that could not travel in a USER_SYNC line is refused, not a 500.
        for user in ("bad user", "line\nbreak"):
            status, got = await sync(session, url, user)
            assert status == 400
            assert "bad user name" in got["error"]
        # A token from the future is clamped to what exists, not waited on.
        started = time.monotonic()
        status, got = await sync(session, url, "alice", "s999999_s0_t0", wait_ms=1_000)
        assert status == 200
        assert time.monotonic() - started < 10
        assert not got["next"].startswith("s999999")


async def test_sync_returns_account_data_in_stream_order_and_typing(db: Database) -> None:
    room = rooms_of("ev1", 1)[0]
    async with chat(db) as url, client() as session:
        await post(
            session, f"{url}/membership", {"room": room, "user": "carol", "membership": "join"}
        )
        status, first = await sync(session, url, "carol")
        since = first["next"]
        # Three tables, one stream: the rows come back in the order they were written.
        a = await post(
            session,
            f"{url}/account_data",
            {"user": "carol", "kind": "theme", "content": {"dark": True}},
        )
        b = await post(session, f"{url}/tags", {"user": "carol", "room": room, "tag": "fav"})
        c = await post(
            session,
            f"{url}/account_data",
            {"user": "carol", "room": room, "kind": "draft", "content": {"text": "hi"}},
        )
        await post(session, f"{url}/account_data", {"user": "dave", "kind": "theme", "content": {}})
        status, got = await sync(session, url, "carol", since)
        assert status == 200
        rows = [(r["stream_id"], r["table"]) for r in got["account_data"]]
        assert rows == [
            (a["stream_id"], "global_account_data"),
            (b["stream_id"], "room_tags"),
            (c["stream_id"], "room_account_data"),
        ]
        assert got["account_data"][0]["content"] == {"dark": True}
        since = got["next"]
        # Typing: an in-memory stream on main, replicated to the sync worker.
        waiting = asyncio.create_task(sync(session, url, "carol", since, wait_ms=10_000))
        await asyncio.sleep(0.2)
        await post(session, f"{url}/typing", {"room": room, "user": "erin", "typing": True})
        status, got = await pace.wait(waiting, 10, "the long-poll to answer with the typing")
        assert got["typing"] == {room: ["erin"]}
        assert got["account_data"] == []
        status, again = await sync(session, url, "carol", got["next"])
        assert again["typing"] == {}  # seen already: not repeated


async def online(chat: Chat) -> list[str]:
    answer = await chat.sync1.call("main", "online", {})
    return list(answer["online"])


async def test_presence_follows_syncs_and_is_cleared_at_once_on_graceful_stop(
    db: Database,
) -> None:
    # The linger must outlast a sync and its report to main: longer on a busy machine.
    async with deployment(db, linger=scaled(0.3)) as running, client() as session:
        url = running.url
        assert await online(running) == []
        # A long-poll in flight: the user is syncing, by this worker's name.
        polling = asyncio.create_task(sync(session, url, "frank", wait_ms=1_500))
        await until_equal(lambda: online(running), ["frank"], "frank online")
        await polling
        # Back to back long-polls within the linger: still online, no flapping.
        await sync(session, url, "frank", wait_ms=100)
        assert await online(running) == ["frank"]
        # After the linger with no sync, offline.
        await until_equal(lambda: online(running), [], "nobody online")
        # Syncing again, then the worker stops gracefully: cleared at once.
        polling = asyncio.create_task(sync(session, url, "gina", wait_ms=20_000))
        await until_equal(lambda: online(running), ["gina"], "gina online")
        started = time.monotonic()
        await running.worker.stop()
        polling.cancel()
        await until_equal(lambda: online(running), [], "nobody online")
        assert time.monotonic() - started < pace.scaled(2)


async def until_equal(get: Callable[[], Awaitable[Any]], expected: Any, what: str) -> None:
    async def equal() -> bool:
        return bool(await get() == expected)

    await pace.until(equal, 10, what, every=0.05)


async def test_backfill_rows_get_negative_ids_and_their_own_token(db: Database) -> None:
    room = rooms_of("ev2", 1)[0]
    async with chat(db) as url, client() as session:
        await post(session, f"{url}/send", {"room": room, "sender": "bob", "body": "now"})
        ids = [
            (await post(session, f"{url}/backfill", {"room": room, "sender": "old", "body": b}))[
                "stream_id"
            ]
            for b in ("older", "oldest")
        ]
        assert all(i < 0 for i in ids)
        assert ids[1] < ids[0]  # each import goes further back
        async with session.get(f"{url}/backfill", params={"room": room}) as response:
            first = await response.json()
        assert [e["body"] for e in first["events"]] == ["older", "oldest"]
        assert first["next"].startswith("s")  # one writer: the simple form
        await post(session, f"{url}/backfill", {"room": room, "sender": "old", "body": "ancient"})
        params = {"room": room, "since": first["next"]}
        async with session.get(f"{url}/backfill", params=params) as response:
            later = await response.json()
        assert [e["body"] for e in later["events"]] == ["ancient"]
        async with session.get(f"{url}/backfill", params={**params, "since": "x"}) as response:
            assert response.status == 400


async def test_the_membership_table_matches_a_recomputation(db: Database) -> None:
    rooms = rooms_of("ev1", 2) + rooms_of("ev2", 2)
    async with deployment(db) as running, client() as session:
        bg = running.instance("bg")
        worker = Memberships(bg, page=3)  # small pages: many transactions
        async with bg:
            task = asyncio.create_task(worker.run())
            try:
                for i in range(24):
                    room, user = rooms[i % 4], f"u{i % 5}"
                    membership = "leave" if i % 3 == 2 else "join"
                    await post(
                        session,
                        f"{running.url}/membership",
                        {"room": room, "user": user, "membership": membership},
                    )
                events = running.sync1.generator("events")

                async def caught_up() -> bool:
                    return worker.position >= events.get_current_token()

                await pace.until(caught_up, 10, "the memberships worker to catch up", every=0.05)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        async with db.connection() as conn:
            cur = await conn.execute(
                "SELECT user_id, room_id, membership, stream_id FROM room_memberships ORDER BY 1, 2"
            )
            kept = await cur.fetchall()
            cur = await conn.execute(
                "SELECT DISTINCT ON (user_id, room_id) user_id, room_id, membership, stream_id"
                " FROM room_state ORDER BY user_id, room_id, stream_id DESC"
            )
            recomputed = await cur.fetchall()
            cur = await conn.execute(
                "SELECT user_id, room_id, membership FROM current_members ORDER BY 1, 2"
            )
            current = await cur.fetchall()
            cur = await conn.execute("SELECT stream_id FROM worker_progress")
            progress = await cur.fetchone()
        assert kept == sorted(recomputed)
        assert len(kept) == 20  # 5 users x 4 rooms
        assert [row[:3] for row in kept] == sorted(current, key=lambda r: (r[0], r[1]))
        assert progress is not None
        assert progress[0] == worker.position


async def test_read_your_writes_across_sync_workers(db: Database) -> None:
    room = rooms_of("ev1", 1)[0]
    async with deployment(db, sync2_lag=1.0) as running, client() as session:
        await post(
            session,
            f"{running.url}/membership",
            {"room": room, "user": "hana", "membership": "join"},
        )
        _, first = await sync(session, running.url2, "hana")
        await asyncio.sleep(0.2)  # sync2 is busy with the join for a second
        sent = await post(
            session, f"{running.url}/send", {"room": room, "sender": "ivo", "body": "hi"}
        )
        # sync2 lags: without `after` it answers at once, without the message...
        _, lagging = await sync(session, running.url2, "hana", first["next"])
        assert sent["stream_id"] not in [e["stream_id"] for e in lagging["events"]]
        # ...with the send's `after` token it waits until it has seen the message.
        query = {"user": "hana", "since": first["next"], "after": sent["after"]}
        async with session.get(f"{running.url2}/sync", params=query) as response:
            got = await response.json()
        assert sent["stream_id"] in [e["stream_id"] for e in got["events"]]
        data = await post(
            session, f"{running.url}/account_data", {"user": "hana", "kind": "k", "content": {}}
        )
        query = {"user": "hana", "since": got["next"], "after": data["after"]}
        async with session.get(f"{running.url2}/sync", params=query) as response:
            got = await response.json()
        assert [r["stream_id"] for r in got["account_data"]] == [data["stream_id"]]


async def test_a_sync_page_is_cut_between_ids_so_nothing_is_skipped(db: Database) -> None:
    """IDs with rows in both tables of `events` (a membership change and its message),
    from two writers at different positions (so the read covers several ranges): pages
    of 1, 2, 4 and 100 rows return all of them, each once, and the token of a cut page
    resumes at the first row not returned."""
    from plait import MultiWriterIdGenerator, StreamSpec, StreamToken, TableSpec
    from plait.demo import sync

    await db.run_schema(schema.TABLES)
    spec = StreamSpec(
        "events", tables=[TableSpec("events"), TableSpec("room_state")], writers=WRITERS
    )
    gens = [await MultiWriterIdGenerator.create(db, spec, w) for w in WRITERS]
    room = "!r:demo"
    try:
        written = []
        last: dict[str, int] = {}
        for n in range(5):
            gen = gens[n % 2]
            writer = gen.instance_name
            async with gen.get_next() as sid, db.transaction() as txn:
                await txn.execute(
                    "INSERT INTO room_state (stream_id, instance_name, room_id, user_id,"
                    " membership) VALUES (%s, %s, %s, %s, 'join')",
                    (sid, writer, room, f"@u{n}"),
                )
                for body in ("hi", "there"):
                    await txn.execute(
                        "INSERT INTO events (stream_id, instance_name, room_id, sender, body)"
                        " VALUES (%s, %s, %s, %s, %s)",
                        (sid, writer, room, f"@u{n}", body),
                    )
            written += [(sid, "room_state"), (sid, "events"), (sid, "events")]
            last[writer] = sid
        end = StreamToken(0, last)  # each writer at its own last ID: one range each
        for limit in (1, 2, 4, 100):
            got, since = [], StreamToken(0)
            while True:
                page = await sync.rows_between(db, spec, "room_id", [room], since, end, limit)
                got += [(row["stream_id"], row["table"]) for row in page.rows]
                if page.token == since:
                    break
                since = page.token
            assert sorted(got) == sorted(written), limit
    finally:
        for gen in gens:
            await gen.close()
