"""Replication commands: one line of UTF-8 text each, parsed and written here. No I/O.

A line is a command name, and for most commands a space and arguments:

    RDATA <stream> <instance> <token|batch> <row-json>
    POSITION <stream> <instance> <prev> <new>
    FENCED <stream> <instance> <position>
    REPLICATE
    NAME <name>
    CHALLENGE <name> <nonce>
    PROOF <nonce> <proof>
    SERVER <name> [<proof>]
    PING <ms>
    ERROR <text>
    DEPART <instance>

Applications add commands of their own by name (`CommandSet.register`). The transports
(Redis, TCP) frame lines and hand them to `CommandSet.parse`, which returns a command or
raises `CommandParseError` and nothing else, whatever the input: a malformed line costs
one ERROR (TCP) or one log line (Redis), never a connection loop.

Names (streams, instances) are non-empty and hold no whitespace. Tokens and positions
are integers, negative on backwards streams. `RDATA` rows are compact JSON, which never
holds a raw line break. Nonces and proofs (the TCP handshake's) are lowercase hex.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, AnyStr, ClassVar, Protocol, Self, overload

from plait.errors import CommandParseError

# Longest line accepted or written, in UTF-8 bytes (transports use it as their limit).
MAX_LINE_BYTES = 1 << 20

_NAME = re.compile(r"[^\s]+")
_HEX = re.compile(r"[0-9a-f]{1,128}")
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]{0,18})")
COMMAND_NAME = re.compile(r"[A-Z][A-Z0-9_]*")  # what a command name may be
_BATCH = "batch"


class Command(Protocol):
    """What every command is: a name, and arguments to and from text."""

    NAME: ClassVar[str]

    @classmethod
    def from_args(cls, args: str) -> Command: ...

    def to_args(self) -> str: ...


def to_line(command: Command) -> str:
    """The command as one line (no line terminator)."""
    args = command.to_args()
    line = f"{command.NAME} {args}" if args else command.NAME
    if "\n" in line or "\r" in line:
        raise ValueError(f"{command.NAME}: a line break inside a command")
    if len(line.encode()) > MAX_LINE_BYTES:
        raise ValueError(
            f"{command.NAME}: {len(line.encode())} bytes is over the {MAX_LINE_BYTES}-byte "
            "line limit; send smaller rows"
        )
    return line


class CommandSet:
    """The commands one process understands: the built-in ones plus its own."""

    def __init__(self, extra: Iterable[type[Command]] = ()) -> None:
        self._by_name: dict[str, type[Command]] = {}
        for command in (*BUILTIN, *extra):
            self.register(command)

    def register(self, command: type[Command]) -> None:
        name = command.NAME
        if not COMMAND_NAME.fullmatch(name):
            raise ValueError(f"command name {name!r}: use capitals, digits and _")
        if name in self._by_name and self._by_name[name] is not command:
            raise ValueError(f"command name {name!r} is registered already")
        self._by_name[name] = command

    def parse(self, line: str | bytes) -> Command:
        """One line (without its terminator) as a command, else `CommandParseError`."""
        if isinstance(line, bytes):
            if len(line) > MAX_LINE_BYTES:
                raise CommandParseError(f"line of {len(line)} bytes is over the limit")
            try:
                line = line.decode()
            except UnicodeDecodeError as err:
                raise CommandParseError(f"line is not UTF-8: {err.reason}") from None
        elif not line.isascii():  # (the flag is kept with the string: no scan)
            try:
                size = len(line.encode())
            except UnicodeEncodeError:
                # A lone surrogate: no UTF-8 line carries it, nor could it be sent on.
                raise CommandParseError("line is not valid Unicode (a lone surrogate)") from None
            if size > MAX_LINE_BYTES:
                raise CommandParseError("line is over the length limit")
        if "\n" in line or "\r" in line:
            raise CommandParseError("a line break inside a line")
        name, _, args = line.partition(" ")
        command = self._by_name.get(name)
        if command is None:
            raise CommandParseError(f"unknown command {_shorten(name)!r}")
        try:
            return command.from_args(args)
        except CommandParseError:
            raise
        except Exception as err:  # an application's parser: a bad line, whatever it raised
            raise CommandParseError(f"{name}: {_shorten(str(err))}") from err


# -- the built-in commands -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rdata:
    """A row of `stream` written by `instance` at `token`; `token` None means "batch":
    more rows with the same token follow, hold them until the one with the number."""

    NAME: ClassVar[str] = "RDATA"
    stream: str
    instance: str
    token: int | None
    row: Any

    @classmethod
    def from_args(cls, args: str) -> Rdata:
        stream, instance, token, row = split_args(
            args, 4, "RDATA <stream> <instance> <token> <row>"
        )
        return cls(
            parse_name(stream, "stream"),
            parse_name(instance, "instance"),
            None if token == _BATCH else parse_integer(token, "token"),
            _json(row),
        )

    def to_args(self) -> str:
        token = _BATCH if self.token is None else str(self.token)
        return f"{_checked(self.stream)} {_checked(self.instance)} {token} {_dump(self.row)}"


@dataclass(frozen=True, slots=True)
class Position:
    """`instance` moved `stream` from `prev` to `new` with no rows in between."""

    NAME: ClassVar[str] = "POSITION"
    stream: str
    instance: str
    prev: int
    new: int

    @classmethod
    def from_args(cls, args: str) -> Position:
        stream, instance, prev, new = split_args(
            args, 4, "POSITION <stream> <instance> <prev> <new>"
        )
        return cls(
            parse_name(stream, "stream"),
            parse_name(instance, "instance"),
            parse_integer(prev, "prev"),
            parse_integer(new, "new"),
        )

    def to_args(self) -> str:
        return f"{_checked(self.stream)} {_checked(self.instance)} {self.prev} {self.new}"


@dataclass(frozen=True, slots=True)
class Fenced:
    """The sender fenced writer `instance` of `stream` up to `position`: none of its
    connections was alive, so all it wrote is committed or rolled back. Unlike POSITION,
    which only the writer itself sends, any instance may send it, so receivers believe
    it only once the writer's stored position is at or past `position` (the fence wrote
    it there before announcing it)."""

    NAME: ClassVar[str] = "FENCED"
    stream: str
    instance: str  # the fenced writer, as in RDATA and POSITION
    position: int

    @classmethod
    def from_args(cls, args: str) -> Fenced:
        stream, instance, position = split_args(args, 3, "FENCED <stream> <instance> <position>")
        return cls(
            parse_name(stream, "stream"),
            parse_name(instance, "instance"),
            parse_integer(position, "position"),
        )

    def to_args(self) -> str:
        return f"{_checked(self.stream)} {_checked(self.instance)} {self.position}"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Ask every peer for its current positions."""

    NAME: ClassVar[str] = "REPLICATE"

    @classmethod
    def from_args(cls, args: str) -> Replicate:
        if args:
            raise CommandParseError("REPLICATE takes no arguments")
        return cls()

    def to_args(self) -> str:
        return ""


@dataclass(frozen=True, slots=True)
class Named:
    """A command whose one argument is an instance name (a base for applications'
    commands too, like the argument helpers below)."""

    NAME: ClassVar[str]
    name: str

    @classmethod
    def from_args(cls, args: str) -> Self:
        return cls(parse_name(args, "name"))

    def to_args(self) -> str:
        return _checked(self.name)


@dataclass(frozen=True, slots=True)
class Name(Named):
    """A client tells the hub its instance name."""

    NAME: ClassVar[str] = "NAME"


@dataclass(frozen=True, slots=True)
class Server:
    """The hub tells a client its instance name, and that the handshake is over. A hub
    with a secret adds its proof of it (see `Challenge`)."""

    NAME: ClassVar[str] = "SERVER"
    name: str
    proof: str | None = None

    @classmethod
    def from_args(cls, args: str) -> Server:
        name, _, proof = args.partition(" ")
        return cls(parse_name(name, "name"), parse_hex(proof, "proof") if proof else None)

    def to_args(self) -> str:
        name = _checked(self.name)
        return name if self.proof is None else f"{name} {_checked_hex(self.proof)}"


@dataclass(frozen=True, slots=True)
class Challenge:
    """A hub with a secret answers NAME with its name and a fresh nonce: the client must
    prove it holds the secret (`Proof`) before anything else is taken from it."""

    NAME: ClassVar[str] = "CHALLENGE"
    name: str
    nonce: str

    @classmethod
    def from_args(cls, args: str) -> Challenge:
        name, nonce = split_args(args, 2, "CHALLENGE <name> <nonce>")
        return cls(parse_name(name, "name"), parse_hex(nonce, "nonce"))

    def to_args(self) -> str:
        return f"{_checked(self.name)} {_checked_hex(self.nonce)}"


@dataclass(frozen=True, slots=True)
class Proof:
    """A client's answer to `Challenge`: a fresh nonce of its own (the hub's proof in
    `Server` must cover it) and its proof of the secret."""

    NAME: ClassVar[str] = "PROOF"
    nonce: str
    proof: str

    @classmethod
    def from_args(cls, args: str) -> Proof:
        nonce, proof = split_args(args, 2, "PROOF <nonce> <proof>")
        return cls(parse_hex(nonce, "nonce"), parse_hex(proof, "proof"))

    def to_args(self) -> str:
        return f"{_checked_hex(self.nonce)} {_checked_hex(self.proof)}"


@dataclass(frozen=True, slots=True)
class Depart(Named):
    """An instance is shutting down cleanly: peers drop what they keep per instance at
    once (R-RP-8) instead of waiting for it to time out."""

    NAME: ClassVar[str] = "DEPART"


@dataclass(frozen=True, slots=True)
class Ping:
    """Keep-alive, with the sender's clock in milliseconds."""

    NAME: ClassVar[str] = "PING"
    ms: int

    @classmethod
    def from_args(cls, args: str) -> Ping:
        return cls(parse_integer(args, "ms"))

    def to_args(self) -> str:
        return str(self.ms)


@dataclass(frozen=True, slots=True)
class Error:
    """Something the peer sent was wrong; free text."""

    NAME: ClassVar[str] = "ERROR"
    text: str

    @classmethod
    def from_args(cls, args: str) -> Error:
        return cls(args)

    def to_args(self) -> str:
        # Error texts come from exceptions: fold line breaks rather than refuse them.
        return self.text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


BUILTIN: tuple[type[Command], ...] = (
    Rdata,
    Position,
    Fenced,
    Replicate,
    Name,
    Server,
    Challenge,
    Proof,
    Depart,
    Ping,
    Error,
)

# Commands a transport handles itself and never relays or hands to the handler.
CONNECTION_COMMANDS = frozenset({Ping.NAME, Name.NAME, Server.NAME, Challenge.NAME, Proof.NAME})


def command_name(line: str) -> str:
    """The command name of a line (cheap: no parsing), for routing in transports."""
    end = line.find(" ")  # not partition: that would copy the rest (up to 1 MiB)
    return line if end < 0 else line[:end]


# -- argument helpers, for built-in and application commands ---------------------------


_ROW_PREFIXES = ("RDATA ", "POSITION ")
_ROW_PREFIXES_BYTES = (b"RDATA ", b"POSITION ")


@overload
def rows_of(line: str, instance: str) -> bool: ...
@overload
def rows_of(line: bytes, instance: bytes) -> bool: ...
def rows_of(line: str | bytes, instance: str | bytes) -> bool:
    """Whether `line` is RDATA or POSITION of `instance` (`<command> <stream> <instance>
    ...`), found without parsing or copying its row (up to 1 MiB); a line in bytes takes
    the name in bytes. Redis hands an instance its own lines back; the TCP hub refuses
    them from anyone else."""
    if isinstance(line, bytes) and isinstance(instance, bytes):
        return _rows_of(line, _ROW_PREFIXES_BYTES, instance, b" ")
    if isinstance(line, str) and isinstance(instance, str):
        return _rows_of(line, _ROW_PREFIXES, instance, " ")
    raise TypeError("rows_of: the line and the instance name must both be str, or both bytes")


def _rows_of(line: AnyStr, prefixes: tuple[AnyStr, ...], instance: AnyStr, space: AnyStr) -> bool:
    if not line.startswith(prefixes):
        return False
    start = line.find(space, line.find(space) + 1) + 1
    if start == 0:
        return False
    end = start + len(instance)
    return line.startswith(instance, start) and (end == len(line) or line[end : end + 1] == space)


def split_args(args: str, count: int, usage: str) -> list[str]:
    """`count` space-separated fields, the last one taking the rest of the line."""
    parts = args.split(" ", count - 1)
    if len(parts) != count or not all(parts):
        raise CommandParseError(f"expected {usage}")
    return parts


def parse_name(text: str, what: str) -> str:
    if not _NAME.fullmatch(text):
        raise CommandParseError(f"bad {what} name {_shorten(text)!r}")
    return text


def _checked(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"name {name!r}: must be non-empty, without whitespace")
    return name


def parse_hex(text: str, what: str) -> str:
    if not _HEX.fullmatch(text):
        raise CommandParseError(f"bad {what} {_shorten(text)!r}: expected lowercase hex")
    return text


def _checked_hex(text: str) -> str:
    if not _HEX.fullmatch(text):
        raise ValueError(f"{text!r}: must be 1 to 128 lowercase hex digits")
    return text


def parse_integer(text: str, what: str) -> int:
    if not _INTEGER.fullmatch(text):
        raise CommandParseError(f"bad {what} {_shorten(text)!r}: expected an integer")
    return int(text)


def _reject_constant(name: str) -> Any:
    raise CommandParseError(f"{name} is not JSON")


# One decoder for every row: `json.loads` with an option builds a new one per call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _json(text: str) -> Any:
    try:
        return _DECODER.decode(text)
    except CommandParseError:
        raise
    except (ValueError, RecursionError) as err:
        raise CommandParseError(f"bad row JSON: {_shorten(str(err))}") from None


def _dump(row: Any) -> str:
    return json.dumps(row, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def with_sign(command: Command, sign: int) -> Command:
    """A command of the internal domain as it goes on the wire (or the reverse)."""
    if sign == 1:
        return command
    if isinstance(command, Rdata):
        token = None if command.token is None else sign * command.token
        return dataclasses.replace(command, token=token)
    if isinstance(command, Position):
        return dataclasses.replace(command, prev=sign * command.prev, new=sign * command.new)
    if isinstance(command, Fenced):
        return dataclasses.replace(command, position=sign * command.position)
    return command
