"""The TCP transport's settings, with their defaults and bounds in one place. The hub
(`TcpHub`) and the client (`TcpClient`) take a `TcpOptions` as it is, and the
configuration's `replication.tcp` is one with the hub's name added
(`plait.config.TcpConfig`), so a bound is checked once, by the model, whichever way the
transport is built."""

from __future__ import annotations

from pydantic import Field

from plait.options import Options

DEFAULT_PORT = 9093


class TcpOptions(Options):
    """How the TCP transport connects, and when it gives up on a peer (seconds)."""

    host: str = "127.0.0.1"
    """The hub's address."""
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    """The hub's port (0: a hub takes any free one)."""
    ping_interval: float = Field(5.0, gt=0)
    """Seconds between pings on an idle connection."""
    dead_after: float = Field(25.0, gt=0)
    """Seconds of silence after which a connection is taken for dead and closed."""
    send_queue: int = Field(10_000, ge=1)
    """Lines the hub holds for a peer that does not read; past it the peer is cut off."""
    handshake_timeout: float = Field(3.0, gt=0)
    """The hub closes a connection that has not finished the handshake (NAME, and with
    `replication.secret` the proof) within this many seconds."""
    connect_timeout: float = Field(5.0, gt=0)
    """Seconds a client gives connecting to the hub and its handshake."""
