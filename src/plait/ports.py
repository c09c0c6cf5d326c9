"""A TCP port for a server this process is about to start (the demo, the checker, tests).

A port from bind(0) lies in the kernel's ephemeral range, the range it also takes the
local ports of outgoing connections from: between the pick and the server's bind, any
process's connect() (a database pool filling up, a Redis client reconnecting) may take
it, and the server fails with "address already in use" (seen in CI). A client connecting
to a stopped server on such a port can even connect to itself. Ports are therefore
picked at random below that range and checked free; where the range cannot be read, or
leaves too little room below it, bind(0) it is.
"""

from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# The lowest port picked: above the registered ports most services use.
_LOWEST = 20_000
# Fewer candidates than this below the ephemeral range: use bind(0).
_ROOM = 2_000
_ATTEMPTS = 100
# SystemRandom: Hypothesis seeds the `random` module in tests, and processes started
# alike would pick alike.
_random = random.SystemRandom()
_handed: set[int] = set()  # never the same port twice in one process


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to right now and that no outgoing
    connection will take meanwhile (where the ephemeral range can be read)."""
    ephemeral = ephemeral_range()
    if ephemeral is not None and ephemeral[0] - _LOWEST >= _ROOM:
        for _ in range(_ATTEMPTS):
            port = _random.randrange(_LOWEST, ephemeral[0])
            if port not in _handed and _bindable(port):
                _handed.add(port)
                return port
    return _kernel_port()


def ephemeral_range() -> tuple[int, int] | None:
    """The kernel's range of local ports for outgoing connections (Linux), or None."""
    try:
        low, high = (int(part) for part in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def _bindable(port: int) -> bool:
    # No SO_REUSEADDR: a port a closing connection still holds counts as taken.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) only listens on this machine. Names other
    than localhost may resolve anywhere, and an empty host means every interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
