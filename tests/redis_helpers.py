"""What the Redis transport tests share: a recording handler and its sessions, channels."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from plait.replication.link import Handler, Link
from plait.replication.redis_options import RedisOptions, RedisTls
from plait.replication.redis_transport import RedisTransport


class RecordingSession:
    """What the transport did to one connection's session."""

    def __init__(self, handler: RecordingHandler, link: Link, number: int) -> None:
        self.link = link
        self.number = number
        self.authenticated = False  # what the transport said when it opened the session
        self.raw: list[str | bytes] = []
        self.closed_calls = 0
        self.opened_at = time.monotonic()
        self.closed_at: float | None = None
        self._handler = handler

    @property
    def lines(self) -> list[str]:
        return [x.decode() if isinstance(x, bytes) else x for x in self.raw]

    def received(self, line: str | bytes) -> None:
        self.raw.append(line)
        if line in (b"BOOM", "BOOM"):  # a session bug, which the transport must survive
            raise RuntimeError("boom")

    async def wait_up(self) -> None:
        await self._handler.may_be_up.wait()

    def closed(self) -> None:
        self.closed_calls += 1
        self.closed_at = time.monotonic()


class RecordingHandler:
    """Opens a RecordingSession per connection and, like the real handler, sends
    REPLICATE and a position of its own through the link at once."""

    def __init__(self, name: str, *, up: bool = True) -> None:
        self.name = name
        self.sessions: list[RecordingSession] = []
        self.may_be_up = asyncio.Event()  # wait_up() returns once this is set
        if up:
            self.may_be_up.set()

    @property
    def instance_name(self) -> str:
        return self.name

    def open(
        self, link: Link, *, reply_errors: bool, authenticated: bool = False
    ) -> RecordingSession:
        assert not reply_errors  # Redis: malformed lines are only logged
        session = RecordingSession(self, link, len(self.sessions))
        session.authenticated = authenticated
        self.sessions.append(session)
        link.send("REPLICATE")
        link.send(self.open_line(session.number))
        return session

    def open_line(self, number: int) -> str:
        return f"POSITION s {self.name} 0 {number}"

    @property
    def session(self) -> RecordingSession:
        return self.sessions[-1]


def channel() -> str:
    return f"plait-test-{uuid.uuid4().hex}"


def redis_transport(
    handler: Handler, url: str, channel: str, *, tls: RedisTls | None = None, **settings: Any
) -> RedisTransport:
    """A transport for these test settings: the transport's own (secret, backoff,
    metrics) and its options' (`RedisOptions`; `tls` as its ssl_* settings)."""
    own = {k: settings.pop(k) for k in ("secret", "backoff", "metrics") if k in settings}
    if tls is not None:
        settings.update(
            ssl_ca_certs=tls.ca_certs,
            ssl_certfile=tls.certfile,
            ssl_keyfile=tls.keyfile,
            ssl_cert_reqs=tls.cert_reqs,
            ssl_check_hostname=tls.check_hostname,
        )
    return RedisTransport(handler, RedisOptions(url=url, **settings), channel=channel, **own)
