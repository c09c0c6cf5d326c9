"""A TCP proxy that breaks connections on demand: in front of the replication hub, so
the checker can cut connections, and in front of PostgreSQL, so tests can lose an
answer.

Every client connects to the proxy, which opens one connection to the target for each;
`cut()` aborts a pair (a reset both ways, as a failed network would), and
`lose_next_answer()` aborts the pair whose target speaks next, dropping what it said:
the server did the work, the client never hears of it. `black_hole()` stops forwarding
in both directions, closing nothing, as a network partition would: whatever either side
sends (an end of stream too) waits in the proxy until `heal()`. Unlike a real partition,
the proxy's kernel still acknowledges both sides' packets, so neither side's TCP
keepalives or `tcp_user_timeout` notice it: only time-based limits do
(`idle_in_transaction_session_timeout`). `drop_all()` plays the kernels' part: every
connection held ends both ways at once, as each end's keepalives would end it once the
silence outlasted them (the checker's `pg_partition` calls it after that long).
"""

from __future__ import annotations

import asyncio
import contextlib
import random


class CutProxy:
    def __init__(
        self,
        listen_port: int,
        target_port: int,
        host: str = "127.0.0.1",
        target_host: str | None = None,
        target_unix: str | None = None,
    ) -> None:
        self._listen = listen_port  # 0: any free port (see `port`)
        self._target = (target_host or host, target_port)
        self._target_unix = target_unix  # a Unix socket's path in place of the target
        self._host = host
        self._server: asyncio.Server | None = None
        self._pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._pipes: dict[
            tuple[asyncio.StreamWriter, asyncio.StreamWriter], list[asyncio.Task[None]]
        ] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._lose_answer = False
        self.answers_lost = 0
        # Set while traffic flows; cleared by `black_hole()`.
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._stopped = False

    async def start(self) -> None:
        """Listen (again, after `stop()`: a proxy can be stopped and started)."""
        self._stopped = False
        self._server = await asyncio.start_server(self._accept, self._host, self._listen)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    def lose_next_answer(self) -> None:
        """The target's next bytes, on any connection, are dropped and that pair cut."""
        self._lose_answer = True

    def cut(self, rng: random.Random) -> bool:
        """Abort one proxied connection, both ways; False when there is none."""
        if not self._pairs:
            return False
        self._end(self._pairs.pop(rng.randrange(len(self._pairs))))
        return True

    def drop_all(self) -> int:
        """Abort every connection made so far, both ways, and drop what it held (a
        black hole goes on for new ones): how many there were."""
        pairs, self._pairs = self._pairs, []
        for pair in pairs:
            self._end(pair)
        return len(pairs)

    def _end(self, pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        """A reset both ways; its pipes end too, also those a black hole holds."""
        for writer in pair:
            writer.transport.abort()
        for task in self._pipes.get(pair, []):
            task.cancel()

    def black_hole(self) -> None:
        """Forward nothing more, either way, on any connection (new ones too), and close
        nothing, until `heal()`."""
        self._flowing.clear()

    def heal(self) -> None:
        """Forward again, in order, what was held since `black_hole()`."""
        self._flowing.set()

    async def stop(self) -> None:
        self._stopped = True
        self._flowing.set()  # connections accepted during a black hole end below
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
        await self._flowing.wait()  # a partition: the target hears of nobody new
        if self._stopped:
            writer.transport.abort()
            return
        try:
            if self._target_unix is not None:
                up_reader, up_writer = await asyncio.open_unix_connection(self._target_unix)
            else:
                up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self._pairs.append(pair)
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer, pair)),
        ]
        self._tasks.update(pipes)
        self._pipes[pair] = pipes
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for task in pipes:
            task.cancel()
            self._tasks.discard(task)
        await asyncio.gather(*pipes, return_exceptions=True)
        del self._pipes[pair]
        with contextlib.suppress(ValueError):
            self._pairs.remove(pair)
        writer.transport.abort()
        up_writer.transport.abort()

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        answers_of: tuple[asyncio.StreamWriter, asyncio.StreamWriter] | None = None,
    ) -> None:
        """Copy one way; `answers_of` is the pair when this is the target's side."""
        try:
            while True:
                data = await reader.read(65536)
                await self._flowing.wait()  # held, not lost, during a black hole
                if not data:
                    return
                if answers_of is not None and self._lose_answer:
                    self._lose_answer = False
                    self.answers_lost += 1
                    for end in answers_of:
                        end.transport.abort()
                    return
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            await self._flowing.wait()  # a reset crosses no black hole either
