"""The sync token: where a client stands in every stream `/sync` returns, in one string.

`{events}_{account_data}_t{typing}`: the events and account-data parts are plait stream
tokens in their text form (`s5`, or `m5~1.9~2.7` for writers ahead of the minimum; `_`
never occurs in them), the typing part the position of the in-memory typing stream.
Parsing is pure (writer ids stay ids); `resolve` turns them into writer names with the
instance map. A token from the future is clamped to what exists (R-TK-2), never waited
on.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from plait.core.tokens import StreamToken, decode_text
from plait.errors import TokenParseError

_TYPING = re.compile(r"t[0-9]{1,19}")


@dataclass(frozen=True, slots=True)
class Parsed:
    """A sync token as written: each vector part as (min, {writer id: position})."""

    text: str
    events: tuple[int, dict[int, int]]
    account_data: tuple[int, dict[int, int]]
    typing: int


@dataclass(frozen=True, slots=True)
class SyncToken:
    events: StreamToken
    account_data: StreamToken
    typing: int

    def encode(self, ids: Mapping[str, int]) -> str:
        """The text form, given each writer's compact id (from `instance_map`)."""
        return f"{self.events.encode_text(ids)}_{self.account_data.encode_text(ids)}_t{self.typing}"

    def clamp(self, events_max: int, account_data_max: int, typing: int) -> SyncToken:
        """No part beyond what has been handed out (a token from the future, or from
        before a restart of the typing writer)."""
        return SyncToken(
            self.events.bound(events_max),
            self.account_data.bound(account_data_max),
            min(self.typing, typing),
        )

    def advanced(self, other: SyncToken) -> SyncToken:
        """Element-wise the further of the two (never goes back)."""
        return SyncToken(
            self.events.copy_and_advance(other.events),
            self.account_data.copy_and_advance(other.account_data),
            max(self.typing, other.typing),
        )


def parse(text: str) -> Parsed:
    """`TokenParseError` saying which part is wrong for anything malformed."""
    parts = text.split("_")
    if len(parts) != 3:
        raise TokenParseError(
            f"sync token {text[:80]!r} must have 3 parts separated by '_' (events, "
            f"account data, typing), not {len(parts)}"
        )
    events, account_data, typing = parts
    # ASCII digits only: str.isdigit() also takes superscripts, which int() refuses.
    if not _TYPING.fullmatch(typing):
        raise TokenParseError(f"sync token {text[:80]!r}: typing part must be t<position>")
    return Parsed(
        text,
        _part(events, "events", text),
        _part(account_data, "account data", text),
        int(typing[1:]),
    )


def resolve(parsed: Parsed, names: Mapping[int, str]) -> SyncToken:
    """Writer ids to names (`names` from `instance_map`); `TokenParseError` for an id
    this deployment does not know."""
    return SyncToken(
        StreamToken.named(parsed.text, *parsed.events, names),
        StreamToken.named(parsed.text, *parsed.account_data, names),
        parsed.typing,
    )


def writer_ids(parsed: Parsed) -> set[int]:
    return set(parsed.events[1]) | set(parsed.account_data[1])


def _part(value: str, what: str, text: str) -> tuple[int, dict[int, int]]:
    try:
        return decode_text(value)
    except TokenParseError as err:
        raise TokenParseError(f"sync token {text[:80]!r}: {what} part: {err}") from None
