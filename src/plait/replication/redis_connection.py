"""The parts of one connection of the Redis transport (`redis_transport.py`): the
queue its publisher drains (`SendQueue`), the proof that our own PINGs come back
(`Liveness`), the count and warnings of refused lines (`Refusals`), and how lines are
packed into messages (`packed`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from plait.core.commands import MAX_LINE_BYTES, Ping, command_name, to_line
from plait.core.signed_messages import (
    BAD_SIGNATURE,
    FOREIGN,
    GAP,
    MALFORMED,
    OVERSIZED,
    REPLAYED,
    SIGNED_WITHOUT_SECRET,
    STALE,
    UNSIGNED,
)
from plait.replication.metrics import ReplicationMetrics

logger = logging.getLogger("plait.replication.redis_transport")  # what operators filter on

LABEL = "redis"

# Most lines in one pipeline, so that one round trip's buffer stays bounded.
_BATCH_LINES = 10_000
# Lines are packed into messages of at most this many bytes (a longer line travels
# alone): large enough to carry a burst, small enough that no subscriber's read of one
# message holds its event loop for long.
_MESSAGE_BYTES = 64 * 1024
# Refused lines are warned about at most once per this many seconds per reason.
_WARN_INTERVAL = 30.0
# What to tell the operator about each reason lines are refused for.
_REFUSALS = {
    UNSIGNED: (
        "unsigned message(s): a process without replication.secret (or any client of "
        "this Redis allowed to PUBLISH) writes on the deployment's channel; give every "
        "instance the same replication.secret, and see that only they may PUBLISH there"
    ),
    BAD_SIGNATURE: (
        "message(s) whose signature does not verify with this instance's "
        "replication.secret: an instance with another secret (or a forgery); every "
        "instance of the deployment needs the same secret"
    ),
    SIGNED_WITHOUT_SECRET: (
        "signed message(s), but this instance has no replication.secret: give it the "
        "secret the other instances of the deployment have"
    ),
    MALFORMED: "signed message(s) whose header is not this version of plait's",
    REPLAYED: "message(s) seen before (replayed by a client of this Redis)",
    STALE: (
        "message(s) first of their connection here but stamped too far from this "
        "machine's clock (a replay, or clocks out of sync: run NTP, or raise "
        "replication.redis.max_clock_skew)"
    ),
    GAP: "message(s) after a missing one of the same sender (lost or replayed lines)",
    FOREIGN: (
        "line(s) of rows or positions (or a DEPART) of another instance than their "
        "signed sender: only an instance itself may send them"
    ),
    OVERSIZED: "message(s) larger than any plait sends",
}


class SendQueue:
    """The `Link` of one connection: the queue its publisher drains. Closed with its
    connection, after which it drops every line."""

    def __init__(self) -> None:
        self._lines: deque[str] = deque()
        self._waiting = asyncio.Event()  # lines are queued
        self._idle = asyncio.Event()  # nothing queued and nothing being published
        self._idle.set()
        self._dropped = asyncio.Event()  # close() was called: end the connection
        self._closed = False

    @property
    def label(self) -> str:
        return LABEL

    def send(self, line: str) -> None:
        if self._closed:
            return
        self._lines.append(line)
        self._waiting.set()
        self._idle.clear()

    async def take(self) -> list[str]:
        """The oldest queued lines (up to `_BATCH_LINES`, in order), once there are any;
        ConnectionError once the queue is closed."""
        while not self._lines:
            if self._closed:
                raise ConnectionError("the connection is closed")
            self._waiting.clear()
            await self._waiting.wait()
        count = min(len(self._lines), _BATCH_LINES)
        return [self._lines.popleft() for _ in range(count)]

    def published(self) -> None:
        """The lines last taken are on the server."""
        if not self._lines:
            self._idle.set()

    async def drained(self) -> None:
        """Returns once every line queued so far is published (or the queue closed)."""
        await self._idle.wait()

    def close(self) -> None:
        """Drop the connection (the handler calls this when catching up failed)."""
        self._closed = True
        self._lines.clear()
        self._idle.set()
        self._dropped.set()
        self._waiting.set()  # a publisher waiting for lines learns it is over

    async def until_closed(self) -> None:
        """Raises once `close()` was called, ending the connection."""
        await self._dropped.wait()
        raise ConnectionError("the handler closed the connection")


class Liveness:
    """When one of our own PINGs last came back through the subscription: the proof that
    both connections reach the same server. Hearing other instances proves only the
    subscription; a publisher whose lines go nowhere would go unnoticed while they talk,
    and every peer would wait for this instance forever."""

    _KEPT = 16  # PINGs awaited at most (older ones count as lost)

    def __init__(self, now: float) -> None:
        self.last_echo = now
        self._awaited: dict[bytes, None] = {}
        self._last_ms = 0

    def ping(self, now_ms: int) -> str:
        """The next PING line to send: unique for this connection (its ms strictly grow)."""
        self._last_ms = max(self._last_ms + 1, now_ms)
        line = to_line(Ping(self._last_ms))
        self._awaited[line.encode()] = None
        while len(self._awaited) > self._KEPT:
            del self._awaited[next(iter(self._awaited))]
        return line

    def heard(self, line: bytes, now: float) -> None:
        """A PING line came through the subscription (ours, or another instance's)."""
        if line in self._awaited:
            del self._awaited[line]
            self.last_echo = now


class Refusals:
    """Counts refused lines by reason (a metric) and warns about each reason at most
    once per `_WARN_INTERVAL`, with the count since its last warning: a peer with
    another secret, or a flood, costs a log line per interval, never one per line."""

    def __init__(self, metrics: ReplicationMetrics, channel: str) -> None:
        self._metrics = metrics
        self._channel = channel
        self._counters: dict[str, Any] = {}
        self._pending: dict[str, int] = {}
        self._next_warning: dict[str, float] = {}

    def refuse(self, reason: str, lines: int, sender: bytes | None, detail: str = "") -> None:
        counter = self._counters.get(reason)
        if counter is None:
            counter = self._counters[reason] = self._metrics.refused_lines.labels(LABEL, reason)
        counter.inc(lines)
        pending = self._pending[reason] = self._pending.get(reason, 0) + lines
        now = time.monotonic()
        if now < self._next_warning.get(reason, 0.0):
            return
        self._next_warning[reason] = now + _WARN_INTERVAL
        self._pending[reason] = 0
        origin = "" if sender is None else f" from {sender.decode(errors='replace')}"
        logger.warning(
            "redis transport: dropped %d line(s) on %s%s: %s%s (counted in "
            "plait_refused_lines_total{reason=%r}; warned about at most every %g s)",
            pending,
            self._channel,
            origin,
            _REFUSALS[reason],
            f"; last: {detail}" if detail else "",
            reason,
            _WARN_INTERVAL,
        )


def packed(lines: list[str]) -> list[bytes]:
    """The lines as messages: consecutive lines joined by newlines, each message at
    most `_MESSAGE_BYTES` unless one line alone is longer; lines no receiver could
    take are dropped (logged)."""
    messages: list[bytes] = []
    current: list[bytes] = []
    size = 0
    for line in lines:
        data = _encoded(line)
        if data is None:
            continue
        if current and size + 1 + len(data) > _MESSAGE_BYTES:
            messages.append(b"\n".join(current))
            current, size = [], 0
        current.append(data)
        size += len(data) + (1 if size else 0)
    if current:
        messages.append(b"\n".join(current))
    return messages


def _encoded(line: str) -> bytes | None:
    """`line` as UTF-8, or None (logged) when no receiver could take it: a bad line
    costs a log line, never the connection."""
    try:
        data = line.encode()
    except UnicodeEncodeError as err:  # a lone surrogate
        logger.error("redis transport: dropped a %s line: %s", command_name(line), err)
        return None
    if b"\n" in data:  # would split into two lines at the receiver
        logger.error("redis transport: dropped a %s line holding a line break", command_name(line))
        return None
    if len(data) > MAX_LINE_BYTES:
        logger.error(
            "redis transport: dropped a %s line of %d bytes (the limit is %d)",
            command_name(line),
            len(data),
            MAX_LINE_BYTES,
        )
        return None
    return data
