"""What the internal HTTP API tests share: endpoint and catch-up doubles, raw requests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from plait.replication.http_api import CatchUpPage
from plait.replication.http_client import InternalClient
from plait.replication.http_server import InternalApi

SECRET = "s3cret-token"
StartApi = Callable[..., Awaitable[InternalApi]]
MakeClient = Callable[..., InternalClient]


async def already_seen(instance: str, positions: dict[str, int]) -> None:
    return None


async def no_streams(
    stream: str, from_exclusive: int, to_inclusive: int, limit: int
) -> CatchUpPage:
    raise KeyError(stream)


class Counter:
    """An endpoint handler that counts its runs, can be held at a gate, and can take
    `delay` seconds."""

    def __init__(self, *, hold: bool = False, delay: float = 0.0) -> None:
        self.runs = 0
        self.delay = delay
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        if not hold:
            self.gate.set()

    async def __call__(self, args: Any) -> Any:
        self.runs += 1
        self.started.set()
        await self.gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        return {"echo": args, "run": self.runs}


class MemoryStream:
    """A catch-up source over rows held in memory, like an in-memory stream's writer."""

    def __init__(self, name: str, rows: dict[int, Any], *, lost_upto: int = 0) -> None:
        self.name = name
        self.rows = rows
        self.lost_upto = lost_upto  # rows at or below this were lost in a restart
        self.asked: list[tuple[str, int, int, int]] = []

    async def __call__(self, stream: str, from_: int, to: int, limit: int) -> CatchUpPage:
        self.asked.append((stream, from_, to, limit))
        if stream != self.name:
            raise KeyError(stream)
        if from_ < self.lost_upto:
            rows = sorted(self.rows.items())[:limit]
            return CatchUpPage(rows=rows, upto=max(self.rows), limited=False, reset=True)
        wanted = sorted((t, r) for t, r in self.rows.items() if from_ < t <= to)
        if len(wanted) > limit:
            page = wanted[:limit]
            return CatchUpPage(rows=page, upto=page[-1][0], limited=True, reset=False)
        return CatchUpPage(rows=wanted, upto=to, limited=False, reset=False)


async def raw_request(port: int, request: bytes) -> tuple[int, bytes]:
    """Sends bytes as they are (headers no HTTP library would send) and returns the
    status and the body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body
