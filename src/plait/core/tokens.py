"""Vector-clock stream tokens: the algebra and the text and JSON forms. No I/O here.

A token is a minimum position plus the writers strictly ahead of it. It stands for the
function "writer -> position" that is `writers[w]` for listed writers and `min` for
every other writer, so two tokens are equal exactly when those functions are equal:
that is why an entry at or below `min` is rejected rather than kept.

- `is_before_or_eq` is the pointwise order (a partial order).
- `copy_and_advance` is the pointwise maximum (the join): commutative, associative,
  idempotent and an upper bound of both arguments.
- `bound(m)` clamps every component to at most `m`.

Text form: `s{min}` without writers, `m{min}~{id}.{pos}~...` with writers, where `id`
is the writer's compact number from plait's `instance_map` table. The mapping is the
caller's business: `encode_text` and `decode_text` take and give numbers, and the two
`async` helpers on `StreamToken` only look names up through the given object.

Positions in tokens are never negative; a backwards stream's token holds magnitudes.
Nor are they ever above `MAX_POSITION`: IDs are PostgreSQL BIGINTs, so a larger number
is no position of any stream, and is refused when parsed (before a caller could plan
work by it).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from plait.errors import TokenParseError

logger = logging.getLogger(__name__)

# Longest text we even try to parse; a real token is far shorter.
MAX_TOKEN_TEXT = 64 * 1024
# The largest ID a stream can hand out: PostgreSQL's BIGINT maximum.
MAX_POSITION = 2**63 - 1
_RANGE = f"a non-negative integer of at most {MAX_POSITION} (PostgreSQL's BIGINT)"
_NUMBER = r"(?:0|[1-9][0-9]{0,18})"
_SIMPLE = re.compile(rf"s({_NUMBER})")
_MULTI_HEAD = re.compile(rf"m({_NUMBER})")
_ENTRY = re.compile(rf"({_NUMBER})\.({_NUMBER})")


class PositionSource(Protocol):
    """What `StreamToken.from_generator` needs (a `MultiWriterIdGenerator` has it)."""

    def get_current_token(self) -> int: ...

    def get_positions(self) -> dict[str, int]: ...

    def get_current_token_for_writer(self, instance_name: str) -> int: ...

    @property
    def backwards(self) -> bool: ...


class InstanceNames(Protocol):
    """Maps writer names to compact ids and back (`Database` has it)."""

    async def get_instance_ids(self, names: list[str]) -> dict[str, int]: ...

    async def get_instance_names(self, ids: list[int]) -> dict[int, str]: ...


class StreamToken:
    """An immutable vector clock over one stream's writers."""

    __slots__ = ("_items", "_min", "_writers")

    def __init__(self, min: int, writers: Mapping[str, int] | None = None) -> None:
        if not _is_position(min):
            raise ValueError(f"token min must be {_RANGE}, not {_shorten(repr(min))}")
        clean: dict[str, int] = {}
        # Checked before sorting: names of mixed types would make sorted() raise TypeError.
        for writer, position in (writers or {}).items():
            if not isinstance(writer, str) or not writer:
                raise ValueError(f"token writer names must be non-empty strings, not {writer!r}")
            if not _is_position(position):
                raise ValueError(
                    f"position of {writer!r} must be {_RANGE}, not {_shorten(repr(position))}"
                )
            if position <= min:
                raise ValueError(
                    f"writer {writer!r} at {position} is not ahead of min {min}; "
                    "leave writers at or below min out of the token"
                )
            clean[writer] = position
        clean = dict(sorted(clean.items()))
        self._min = min
        self._writers = clean
        self._items = tuple(clean.items())

    @classmethod
    def normalised(cls, min: int, writers: Mapping[str, int]) -> StreamToken:
        """Like the constructor, but drops writers at or below `min` instead of failing."""
        return cls(min, {w: p for w, p in writers.items() if p > min})

    # -- reading --------------------------------------------------------------------

    @property
    def min(self) -> int:
        return self._min

    @property
    def writers(self) -> dict[str, int]:
        return dict(self._writers)

    def get(self, writer: str) -> int:
        """The position this token gives `writer` (`min` if it is not listed)."""
        return self._writers.get(writer, self._min)

    @property
    def max(self) -> int:
        return max(self._writers.values(), default=self._min)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._items)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StreamToken):
            return NotImplemented
        return self._min == other._min and self._items == other._items

    def __hash__(self) -> int:
        return hash((self._min, self._items))

    def __repr__(self) -> str:
        return f"StreamToken(min={self._min}, writers={self._writers!r})"

    # -- algebra --------------------------------------------------------------------

    def is_before_or_eq(self, other: StreamToken) -> bool:
        """True if every writer's position here is at or below its position in `other`."""
        if self._min > other._min:
            return False
        return all(p <= other.get(w) for w, p in self._items)

    def copy_and_advance(self, other: StreamToken) -> StreamToken:
        """The pointwise maximum of the two tokens."""
        new_min = max(self._min, other._min)
        merged = dict(self._writers)
        for writer, position in other._items:
            merged[writer] = max(position, merged.get(writer, 0))
        return StreamToken.normalised(new_min, merged)

    def bound(self, max_position: int) -> StreamToken:
        """Clamp to `max_position` (the largest ID ever allocated).

        A token from the future (a restored database, another deployment) would
        otherwise be waited on forever; it is clamped and logged instead.
        """
        if self.max <= max_position:
            return self
        logger.warning(
            "token %s is ahead of the largest allocated ID %d; clamping it",
            self,
            max_position,
        )
        cap = max(max_position, 0)
        return StreamToken.normalised(min(self._min, cap), {w: min(p, cap) for w, p in self._items})

    @classmethod
    def from_generator(cls, gen: PositionSource) -> StreamToken:
        """The current token of a generator: persisted-up-to plus writers ahead of it."""
        sign = -1 if gen.backwards else 1
        low = sign * gen.get_current_token()
        writers = {w: sign * gen.get_current_token_for_writer(w) for w in gen.get_positions()}
        return cls.normalised(low, writers)

    # -- text form ------------------------------------------------------------------

    def encode_text(self, ids: Mapping[str, int]) -> str:
        """The text form, given each listed writer's compact id."""
        if not self._items:
            return f"s{self._min}"
        try:
            entries = sorted((ids[w], p) for w, p in self._items)
        except KeyError as missing:
            raise ValueError(f"no instance id given for writer {missing}") from None
        return f"m{self._min}~" + "~".join(f"{i}.{p}" for i, p in entries)

    async def to_string(self, names: InstanceNames) -> str:
        """The text form; writer ids come from (and are added to) `instance_map`."""
        ids = await names.get_instance_ids([w for w, _ in self._items]) if self._items else {}
        return self.encode_text(ids)

    @classmethod
    async def parse(cls, names: InstanceNames, text: str) -> StreamToken:
        """Parse the text form; raises `TokenParseError` for anything malformed."""
        low, by_id = decode_text(text)
        if not by_id:
            return cls(low)
        found = await names.get_instance_names(sorted(by_id))
        return cls.named(text, low, by_id, found)

    @classmethod
    def named(
        cls, text: str, low: int, by_id: Mapping[int, int], names: Mapping[int, str]
    ) -> StreamToken:
        """The token `decode_text(text)` gave (`low`, `by_id`), with writer ids turned
        into names from `instance_map` (`names`); `TokenParseError` for an unknown id."""
        unknown = sorted(set(by_id) - set(names))
        if unknown:
            raise TokenParseError(
                f"token {_shorten(text)!r} names instance id {unknown[0]}, which this "
                "database's instance_map does not know: the token comes from another deployment"
            )
        return cls(low, {names[i]: p for i, p in by_id.items()})

    # -- JSON form (Spark offsets) ------------------------------------------------------

    def to_json_dict(self) -> dict[str, Any]:
        return {"min": self._min, "writers": dict(self._writers)}

    @classmethod
    def from_json_dict(cls, value: object) -> StreamToken:
        """Parse `{"min": m, "writers": {name: pos}}`; raises `TokenParseError`."""
        if not isinstance(value, dict):
            raise TokenParseError(f"a JSON token must be an object, not {type(value).__name__}")
        extra = set(value) - {"min", "writers"}
        if extra:
            raise TokenParseError(f"unknown keys in JSON token: {sorted(extra, key=repr)}")
        low = value.get("min")
        writers = value.get("writers", {})
        if not isinstance(low, int) or not _is_position(low):
            raise TokenParseError(f'JSON token "min" must be {_RANGE}, not {_shorten(repr(low))}')
        if not isinstance(writers, dict):
            raise TokenParseError('JSON token "writers" must be an object of name: position')
        try:
            return cls(low, writers)
        except ValueError as err:
            raise TokenParseError(f"invalid JSON token: {err}") from None


def decode_text(text: str) -> tuple[int, dict[int, int]]:
    """Split a token's text into its min and {instance id: position}.

    Raises `TokenParseError` with the reason for anything that is not a token.
    """
    if not isinstance(text, str):
        raise TokenParseError(f"a token must be text, not {type(text).__name__}")
    if len(text) > MAX_TOKEN_TEXT:
        raise TokenParseError(f"token is {len(text)} characters long; tokens are far shorter")
    simple = _SIMPLE.fullmatch(text)
    if simple:
        return _in_range(text, int(simple.group(1))), {}
    head, sep, rest = text.partition("~")
    multi = _MULTI_HEAD.fullmatch(head)
    if not multi:
        raise TokenParseError(
            f"malformed token {_shorten(text)!r}: expected 's<min>' or 'm<min>~<id>.<pos>~...'"
        )
    low = _in_range(text, int(multi.group(1)))
    entries: dict[int, int] = {}
    parts = rest.split("~") if sep else []
    if parts and parts[-1] == "":
        parts.pop()  # tolerate a trailing '~'
    for part in parts:
        entry = _ENTRY.fullmatch(part)
        if not entry:
            raise TokenParseError(
                f"malformed token {_shorten(text)!r}: entry {_shorten(part)!r} is not <id>.<pos>"
            )
        instance_id, position = int(entry.group(1)), _in_range(text, int(entry.group(2)))
        if instance_id in entries:
            raise TokenParseError(
                f"malformed token {_shorten(text)!r}: instance id {instance_id} appears twice"
            )
        if position <= low:
            raise TokenParseError(
                f"malformed token {_shorten(text)!r}: instance id {instance_id} at {position} "
                f"is not ahead of min {low}"
            )
        entries[instance_id] = position
    return low, entries


def _is_position(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_POSITION


def _in_range(text: str, number: int) -> int:
    """`number`, a position in token `text`, if it is one ({0,19} digits can pass it)."""
    if number > MAX_POSITION:
        raise TokenParseError(
            f"malformed token {_shorten(text)!r}: {number} is past {MAX_POSITION}, "
            "the largest ID a stream can have (PostgreSQL's BIGINT)"
        )
    return number


def _shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
