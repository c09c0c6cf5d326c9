"""A TCP proxy in front of PostgreSQL that can lose the server's next answer: the
server did the work (a COMMIT, say), the connection breaks before the client hears
of it. The only way to make "did it commit?" happen on demand, without a mock."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class AnswerLosingProxy:
    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._server: asyncio.Server | None = None
        self._armed = False
        self.lost = 0  # answers lost so far
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    def lose_next_answer(self) -> None:
        """The next bytes the server sends on any connection are dropped, and that
        connection is cut both ways."""
        self._armed = True

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers |= {writer, up_writer}
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer, None)),
            asyncio.create_task(self._pipe(up_reader, writer, (writer, up_writer))),
        ]
        self._tasks.update(pipes)
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for task in pipes:
            task.cancel()
            self._tasks.discard(task)
        writer.transport.abort()
        up_writer.transport.abort()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        answers: tuple[asyncio.StreamWriter, asyncio.StreamWriter] | None,
    ) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if answers is not None and self._armed:
                    self._armed = False
                    self.lost += 1
                    for end in answers:
                        end.transport.abort()
                    return
                writer.write(data)
                await writer.drain()


@asynccontextmanager
async def answer_losing_proxy(dsn: str) -> AsyncIterator[tuple[AnswerLosingProxy, str]]:
    """The proxy in front of `dsn`'s server (host and port), and a DSN through it."""
    params = conninfo_to_dict(dsn)
    proxy = AnswerLosingProxy(
        str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)
    )
    await proxy.start()
    try:
        yield proxy, make_conninfo(dsn, host="127.0.0.1", port=str(proxy.port))
    finally:
        await proxy.stop()
