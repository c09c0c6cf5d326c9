"""What the chat service's public API takes, checked at the door. No I/O.

A sync worker forwards each write to the instance that owns it. A body that instance
cannot store (a missing field, a NUL byte, which PostgreSQL text refuses) would fail
there, and come back as a 502 for a request that was simply wrong. So every body and
query parameter is checked here first: a `BadRequest` (a 400) says which field is
wrong and what it must be.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.core import strict_json
from plait.demo.presence import check_id
from plait.errors import CommandParseError


class BadRequest(ValueError):
    """The request is malformed; the message says which part and why."""


# How a field is checked: "id" (room, user, kind, tag: printable, no whitespace),
# "text" (free text: any that PostgreSQL stores), "json" (any JSON value PostgreSQL
# stores), "flag" (true or false), "membership" (join or leave).
_Fields = Mapping[str, str]

# Each public write's (required, optional) fields; an optional one may also be null.
BODIES: dict[str, tuple[_Fields, _Fields]] = {
    "send_message": ({"room": "id", "sender": "id", "body": "text"}, {}),
    "set_membership": ({"room": "id", "user": "id", "membership": "membership"}, {}),
    "set_account_data": ({"user": "id", "kind": "id", "content": "json"}, {"room": "id"}),
    "set_tag": ({"user": "id", "room": "id", "tag": "id"}, {"content": "json"}),
    "set_typing": ({"room": "id", "user": "id"}, {"typing": "flag"}),
    "backfill": ({"room": "id", "sender": "id", "body": "text"}, {}),
}


def body(endpoint: str, raw: bytes) -> dict[str, Any]:
    """The JSON object in `raw`, checked for `endpoint`'s fields."""
    try:
        value = strict_json.loads(raw)
    except ValueError as err:
        raise BadRequest(f"the body is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise BadRequest("the body must be a JSON object")
    required, optional = BODIES[endpoint]
    unknown = sorted(set(value) - set(required) - set(optional))
    if unknown:
        raise BadRequest(f"unknown fields {unknown[:5]}; {endpoint} takes {_usage(endpoint)}")
    for field, kind in required.items():
        if field not in value:
            raise BadRequest(f"field {field!r} is missing; {endpoint} takes {_usage(endpoint)}")
        _check(field, kind, value[field])
    for field, kind in optional.items():
        if value.get(field) is not None:
            _check(field, kind, value[field])
    # An optional field given as null is left out: the handlers read absent as default.
    return {k: v for k, v in value.items() if not (v is None and k in optional)}


def identifier(value: str, what: str) -> str:
    """`value` as a room or user id (`presence.check_id`)."""
    _check(what, "id", value)
    return value


def _check(field: str, kind: str, value: Any) -> None:
    if kind == "json":
        _storable_json(field, value)
    elif kind == "flag":
        if not isinstance(value, bool):
            raise BadRequest(f"field {field!r} must be true or false")
    elif not isinstance(value, str):
        raise BadRequest(f"field {field!r} must be a string, not {type(value).__name__}")
    elif kind == "membership":
        if value not in ("join", "leave"):
            raise BadRequest(f"field {field!r} must be 'join' or 'leave', not {value[:20]!r}")
    elif kind == "id":
        try:
            check_id(value, f"field {field!r}")
        except CommandParseError as err:
            raise BadRequest(str(err)) from None
    else:
        _storable_text(field, value)


def _storable_text(field: str, value: str) -> None:
    if "\x00" in value:
        raise BadRequest(f"field {field!r} holds a NUL character, which cannot be stored")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise BadRequest(f"field {field!r} holds a lone surrogate (\\ud800-\\udfff)") from None


def _storable_json(field: str, value: Any) -> None:
    """Every string in `value`, keys included, is one jsonb stores (the parser
    already refused everything else)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            _storable_text(field, item)
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


def _usage(endpoint: str) -> str:
    required, optional = BODIES[endpoint]
    return ", ".join([*required, *(f"{field} (optional)" for field in optional)])
