"""The internal HTTP API between plait instances (R-RP-6, R-RP-7): what its server
(`http_server.InternalApi`) and its client (`http_client.InternalClient`) share.

Rules:
- Two kinds of route, both under `/_plait/v1/`: catch-up of an in-memory stream (the rows
  live only in their writer's memory, so a reader that missed some asks the writer) and
  application calls registered by name.
- A call carries the caller's own stream positions and the answer carries the callee's;
  the callee waits for the caller's before running the handler, the caller waits for the
  callee's before `call` returns. So each side sees the other's writes (read-your-writes).
- A call is named by (caller, name, txn_id). The client keeps one txn_id across its
  retries and the server caches the answer (errors included), so a retried call runs its
  handler at most once, even when the retry arrives while the first run is still going.
- With a secret, every `/_plait/` route needs `Authorization: Bearer <secret>`, compared
  in constant time; a missing or wrong one is a 401, never a 500. `/metrics` is open.
- Every error body is JSON `{"error": "..."}`; no request can crash the server.
- The client retries what may pass (refused or dropped connections, timeouts, 502/503/504)
  with capped exponential backoff for `retry_for` seconds; anything else fails at once
  with a `RemoteCallError` carrying the server's error text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from plait.errors import ConfigError
from plait.replication import defaults
from plait.streams.memory import ReadPage

# One page of an in-memory stream's rows, as its writer holds them (one type for the
# page whether it is read locally or over HTTP).
CatchUpPage = ReadPage

# (stream, from_exclusive, to_inclusive, limit); raises KeyError for a stream it does not serve.
CatchUpSource = Callable[[str, int, int, int], Awaitable[CatchUpPage]]
# JSON args -> JSON result.
EndpointHandler = Callable[[Any], Awaitable[Any]]
# stream -> this instance's own writer position, piggybacked on calls and answers.
OwnPositions = Callable[[], dict[str, int]]
# (other instance, {stream: position}): returns once this instance has seen them. The
# implementation bounds its own wait (R-RP-6: on timeout it logs and returns).
AwaitPositions = Callable[[str, dict[str, int]], Awaitable[None]]

PREFIX = "/_plait/v1"
MAX_PAGE_LIMIT = defaults.MAX_PAGE_LIMIT

ENDPOINT_NAME = re.compile(r"[A-Za-z0-9_-]+")
TXN_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
INTEGER = re.compile(r"-?(?:0|[1-9][0-9]{0,18})")
# What a secret may hold: it travels in an HTTP header, so visible ASCII only.
SECRET_TEXT = re.compile(r"[!-~]+")


def check_secret(secret: str | None) -> bytes | None:
    if secret is None:
        return None
    if not isinstance(secret, str) or not SECRET_TEXT.fullmatch(secret):
        raise ConfigError(
            "the internal API secret must be a non-empty string of visible ASCII characters "
            "(no spaces); use None to turn authentication off"
        )
    return secret.encode("ascii")


def check_endpoint_name(name: object) -> str:
    if not isinstance(name, str) or not ENDPOINT_NAME.fullmatch(name):
        raise ConfigError(
            f"endpoint name {name!r} is invalid: use letters, digits, '_' and '-' only"
        )
    return name


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positions_or_none(value: object) -> dict[str, int] | None:
    """`value` as a {stream: position} map, or None when it is not one."""
    if not isinstance(value, dict):
        return None
    if not all(isinstance(k, str) and is_int(v) for k, v in value.items()):
        return None
    return dict(value)


def json_body(payload: object) -> bytes:
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
