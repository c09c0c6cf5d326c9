"""The seam between the transports (Redis, TCP) and the command handler.

A transport owns sockets, framing, pings, timeouts and reconnects. For every connection
that is fully established (Redis: SUBSCRIBE confirmed; TCP: the handshake done) it
calls `Handler.open(link)` once and feeds the returned `Session` every command line it
receives that is not its own business (PING and the handshake's are the transport's; TCP
logs an ERROR received itself, rate-limited). When the connection ends it calls
`Session.closed()` and, after a backoff delay, tries again.

The handler never touches a socket: it writes lines through `Link.send`, which queues
and returns at once, so a slow peer can never block the handler.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class Link(Protocol):
    """One connection as the handler sees it: a place to send command lines."""

    @property
    def label(self) -> str:
        """Short text naming the connection in logs and metrics ("redis", "tcp:worker1")."""
        ...

    def send(self, line: str) -> None:
        """Queue one command line (no terminator). Never blocks and never raises: on a
        closed connection the line is dropped (the peer catches up after reconnecting);
        on a full send queue the transport sends ERROR and closes the connection."""
        ...

    def close(self) -> None:
        """Drop the connection, e.g. because catching up on it failed. Never blocks; the
        transport calls `Session.closed()` and reconnects after its backoff delay."""
        ...


class Session(Protocol):
    """What the handler keeps for one connection; the transport feeds it."""

    def received(self, line: str | bytes) -> None:
        """One received line without its terminator. Never raises: a malformed line is
        answered with ERROR (TCP) or logged and dropped (Redis)."""
        ...

    async def wait_up(self) -> None:
        """Returns once every stream caught up on this connection. The transport resets
        its reconnect backoff only then (R-RP-3)."""
        ...

    def closed(self) -> None:
        """The connection ended: forget what was learned on it."""
        ...


class Handler(Protocol):
    """The one command handler of an instance, shared by both transports and both ends
    of a TCP connection."""

    @property
    def instance_name(self) -> str: ...

    def open(self, link: Link, *, reply_errors: bool, authenticated: bool = False) -> Session:
        """A connection is established. The handler at once sends REPLICATE and its own
        positions through `link` (R-RP-4). `reply_errors`: answer malformed lines with
        ERROR on the link (TCP) rather than only logging them (Redis).
        `authenticated`: every line on it comes from a peer that proved it holds the
        deployment's secret, and a writer's rows and positions only from that writer
        (R-RP-9); the handler then takes a writer's word about its own IDs (a FENCED,
        on another's behalf, it checks against the database on every link)."""
        ...


async def wait_set(event: asyncio.Event, timeout: float) -> bool:  # noqa: ASYNC109
    """Whether `event` is set within `timeout` seconds (a transport's `wait_open`)."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True
