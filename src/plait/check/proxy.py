"""A TCP proxy in front of the replication hub, so the checker can cut connections.

Every instance but the hub connects to the proxy, which opens one connection to the
hub for each; `cut()` aborts a pair (a reset both ways, as a failed network would).
"""

from __future__ import annotations

import asyncio
import contextlib
import random


class CutProxy:
    def __init__(self, listen_port: int, target_port: int, host: str = "127.0.0.1") -> None:
        self._listen = listen_port
        self._target = target_port
        self._host = host
        self._server: asyncio.Server | None = None
        self._pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self._host, self._listen)

    @property
    def connections(self) -> int:
        return len(self._pairs)

    def cut(self, rng: random.Random) -> bool:
        """Abort one proxied connection, both ways; False when there is none."""
        if not self._pairs:
            return False
        pair = self._pairs.pop(rng.randrange(len(self._pairs)))
        for writer in pair:
            writer.transport.abort()
        return True

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for a, b in self._pairs:
            a.transport.abort()
            b.transport.abort()
        self._pairs.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self._host, self._target)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self._pairs.append(pair)
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ]
        self._tasks.update(pipes)
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for task in pipes:
            task.cancel()
            self._tasks.discard(task)
        with contextlib.suppress(ValueError):
            self._pairs.remove(pair)
        writer.transport.abort()
        up_writer.transport.abort()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
