"""The demo's load: simulated users joining, leaving, writing and syncing through the
public API, and an observer in every room who must get every message once (`Tally`
counts what each saw)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

ROOMS = [f"!room{i}:demo" for i in range(8)]
USERS = [f"@user{i}:demo" for i in range(12)]
OBSERVER = "@observer:demo"  # in every room, never leaves: must get every message once


@dataclass
class Tally:
    """What the load did and what the observing client got."""

    sent: dict[int, float] = field(default_factory=dict)  # stream_id -> when sent
    received: dict[int, int] = field(default_factory=dict)  # stream_id -> times received
    latencies: list[float] = field(default_factory=list)
    writes: dict[str, int] = field(default_factory=dict)  # kind -> count
    errors: int = 0

    def count(self, kind: str) -> None:
        self.writes[kind] = self.writes.get(kind, 0) + 1

    def percentile(self, q: float) -> float | None:
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in self.received.values() if n > 1)


class Load:
    """Simulated users on the sync worker's public API."""

    def __init__(self, url: str, tally: Tally, seed: int = 7) -> None:
        self.url = url
        self.tally = tally
        self.random = random.Random(seed)
        self.joined: dict[str, set[str]] = {user: set() for user in USERS}

    async def post(self, session: aiohttp.ClientSession, path: str, body: Any) -> Any:
        async with session.post(f"{self.url}{path}", json=body) as response:
            if response.status != 200:
                self.tally.errors += 1
                return None
            return await response.json()

    async def setup(self, session: aiohttp.ClientSession) -> None:
        for room in ROOMS:
            await self.post(
                session, "/membership", {"room": room, "user": OBSERVER, "membership": "join"}
            )
        for user in USERS:
            for room in self.random.sample(ROOMS, 3):
                await self.membership(session, user, room, "join")

    async def membership(
        self, session: aiohttp.ClientSession, user: str, room: str, state: str
    ) -> None:
        if await self.post(
            session, "/membership", {"room": room, "user": user, "membership": state}
        ):
            (self.joined[user].add if state == "join" else self.joined[user].discard)(room)
            self.tally.count("membership")

    async def user(self, session: aiohttp.ClientSession, until: float) -> None:
        while time.monotonic() < until:
            user = self.random.choice(USERS)
            roll = self.random.random()
            rooms = sorted(self.joined[user]) or ROOMS[:1]
            room = self.random.choice(rooms)
            if roll < 0.75:
                answer = await self.post(
                    session, "/send", {"room": room, "sender": user, "body": "hello"}
                )
                if answer:
                    self.tally.sent[int(answer["stream_id"])] = time.monotonic()
                    self.tally.count("message")
            elif roll < 0.85:  # join any room, or leave one of several
                target = self.random.choice(ROOMS)
                joined = self.joined[user]
                state = "leave" if target in joined and len(joined) > 1 else "join"
                await self.membership(session, user, target, state)
            elif roll < 0.93:
                if await self.post(
                    session, "/typing", {"room": room, "user": user, "typing": roll < 0.9}
                ):
                    self.tally.count("typing")
            elif roll < 0.98:
                body = {"user": user, "kind": "theme", "content": {"n": self.random.randint(0, 9)}}
                if await self.post(session, "/account_data", body):
                    self.tally.count("account data")
            elif await self.post(
                session, "/backfill", {"room": room, "sender": user, "body": "old"}
            ):
                self.tally.count("backfill")
            await asyncio.sleep(0.005)

    async def observe(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        """The observer's long-poll loop: every message exactly once, and how long after
        its send it arrived."""
        since: str | None = None
        while not stop.is_set():
            query = {"user": OBSERVER, "timeout": "1000", **({"since": since} if since else {})}
            try:
                async with session.get(f"{self.url}/sync", params=query) as response:
                    answer = await response.json()
            except aiohttp.ClientError:
                self.tally.errors += 1
                await asyncio.sleep(0.1)
                continue
            now = time.monotonic()
            for event in answer.get("events", []):
                if event.get("table") != "events":
                    continue
                stream_id = int(event["stream_id"])
                self.tally.received[stream_id] = self.tally.received.get(stream_id, 0) + 1
                sent = self.tally.sent.get(stream_id)
                if sent is not None:
                    self.tally.latencies.append(now - sent)
            since = answer.get("next", since)
