"""Replication commands: round trips, exact wire text, and a parser that only ever
raises its one error type (pure, no I/O)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.core.commands import (
    MAX_LINE_BYTES,
    Challenge,
    Command,
    CommandSet,
    Depart,
    Error,
    Name,
    Ping,
    Position,
    Proof,
    Rdata,
    Replicate,
    Server,
    rows_of,
    to_line,
)
from plait.errors import CommandParseError

COMMANDS = CommandSet()

# Lone surrogates (category Cs): UTF-8 cannot encode them.
SURROGATES: tuple[Literal["Cs"]] = ("Cs",)

names = st.text(
    st.characters(exclude_categories=SURROGATES).filter(lambda c: not c.isspace()),
    min_size=1,
    max_size=20,
)
integers = st.integers(-(2**63) + 1, 2**63 - 1)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | integers
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=SURROGATES)),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(st.characters(exclude_categories=SURROGATES)), inner, max_size=4)
    ),
    max_leaves=12,
)
hex_text = st.text("0123456789abcdef", min_size=1, max_size=128)
commands = st.one_of(
    st.builds(Rdata, names, names, st.none() | integers, json_values),
    st.builds(Position, names, names, integers, integers),
    st.just(Replicate()),
    st.builds(Name, names),
    st.builds(Server, names, st.none() | hex_text),
    st.builds(Challenge, names, hex_text),
    st.builds(Proof, hex_text, hex_text),
    st.builds(Depart, names),
    st.builds(Ping, integers),
    st.builds(
        Error,
        st.text(st.characters(exclude_categories=SURROGATES, exclude_characters="\r\n")),
    ),
)


@given(commands)
def test_every_command_survives_the_wire(command: Command) -> None:
    line = to_line(command)
    assert "\n" not in line
    assert "\r" not in line
    assert COMMANDS.parse(line) == command
    assert COMMANDS.parse(line.encode()) == command


@settings(max_examples=500)
@given(st.text(max_size=300))
def test_any_text_parses_or_raises_the_parse_error(text: str) -> None:
    with contextlib.suppress(CommandParseError):  # any other exception fails the test
        COMMANDS.parse(text)


@settings(max_examples=500)
@given(st.binary(max_size=300))
def test_any_bytes_parse_or_raise_the_parse_error(data: bytes) -> None:
    with contextlib.suppress(CommandParseError):  # any other exception fails the test
        COMMANDS.parse(data)


@settings(max_examples=300)
@given(
    st.sampled_from(["RDATA", "POSITION", "NAME", "SERVER", "PING", "ERROR", "REPLICATE"]),
    st.text(max_size=200),
)
def test_known_names_with_any_arguments_parse_or_raise_the_parse_error(
    name: str, args: str
) -> None:
    with contextlib.suppress(CommandParseError):  # any other exception fails the test
        COMMANDS.parse(f"{name} {args}")


def test_wire_text_is_exact() -> None:
    assert to_line(Rdata("events", "w1", 7, [7, "w1", {"a": "b c"}])) == (
        'RDATA events w1 7 [7,"w1",{"a":"b c"}]'
    )
    assert to_line(Rdata("backfill", "w1", None, {"x": 1})) == 'RDATA backfill w1 batch {"x":1}'
    assert to_line(Position("events", "w1", -5, 12)) == "POSITION events w1 -5 12"
    assert to_line(Replicate()) == "REPLICATE"
    assert to_line(Ping(1700000000000)) == "PING 1700000000000"
    assert to_line(Error("bad\nthing")) == "ERROR bad thing"
    assert to_line(Server("hub")) == "SERVER hub"
    assert to_line(Server("hub", "00ff")) == "SERVER hub 00ff"
    assert to_line(Challenge("hub", "ab")) == "CHALLENGE hub ab"
    assert to_line(Proof("ab", "cd")) == "PROOF ab cd"
    assert COMMANDS.parse("RDATA events w1 batch [1]") == Rdata("events", "w1", None, [1])


@pytest.mark.parametrize(
    "line",
    [
        "",
        "NOPE 1",
        "rdata events w1 7 {}",
        "RDATA events w1 7",
        "RDATA events w1 seven {}",
        "RDATA events w1 7 {not json}",
        "RDATA events w1 7 NaN",
        "RDATA events w1 7 " + "[" * 100_000,
        "RDATA  events w1 7 {}",
        "POSITION events w1 1",
        "POSITION events w1 1 2 3",
        "POSITION events w1 +1 2",
        "POSITION events w1 01 2",
        "POSITION events w1 1 ٣",
        "POSITION events w1 1 99999999999999999999",
        "PING",
        "PING soon",
        "NAME",
        "NAME a b",
        "SERVER hub XYZ",
        "SERVER hub ab cd",
        "CHALLENGE hub",
        "CHALLENGE hub AB",
        "PROOF ab",
        "PROOF ab cd ef",
        "PROOF " + "a" * 129 + " cd",
        "REPLICATE now",
        "ERROR a\nb",
        "A" * (MAX_LINE_BYTES + 1),
    ],
)
def test_malformed_lines_say_what_is_wrong(line: str) -> None:
    with pytest.raises(CommandParseError):
        COMMANDS.parse(line)


def test_invalid_utf8_and_oversized_bytes_are_parse_errors() -> None:
    with pytest.raises(CommandParseError, match="UTF-8"):
        COMMANDS.parse(b"NAME \xff")
    with pytest.raises(CommandParseError, match="limit"):
        COMMANDS.parse(b"PING " + b"1" * MAX_LINE_BYTES)


def test_commands_that_cannot_be_sent_are_refused_when_written() -> None:
    with pytest.raises(ValueError, match="whitespace"):
        to_line(Name("two words"))
    with pytest.raises(ValueError, match="whitespace"):
        to_line(Position("", "w1", 1, 2))
    with pytest.raises(ValueError, match="line limit"):
        to_line(Rdata("events", "w1", 1, "x" * MAX_LINE_BYTES))
    with pytest.raises(ValueError, match="JSON compliant"):
        to_line(Rdata("events", "w1", 1, float("nan")))


@dataclass(frozen=True, slots=True)
class UserSync:
    """An application's command, as the reference application would declare it."""

    NAME: ClassVar[str] = "USER_SYNC"
    instance: str
    user: str
    active: bool

    @classmethod
    def from_args(cls, args: str) -> UserSync:
        instance, user, state = args.split(" ")
        return cls(instance, user, {"start": True, "end": False}[state])

    def to_args(self) -> str:
        return f"{self.instance} {self.user} {'start' if self.active else 'end'}"


def test_application_commands_are_registered_by_name() -> None:
    mine = CommandSet([UserSync])
    command = UserSync("sync1", "@alice:example.org", True)
    line = to_line(command)
    assert line == "USER_SYNC sync1 @alice:example.org start"
    assert mine.parse(line) == command
    with pytest.raises(CommandParseError, match="unknown command"):
        COMMANDS.parse(line)  # a process that did not register it
    # Whatever the application's parser raises on a bad line becomes the parse error.
    for bad in ("USER_SYNC sync1 @alice:example.org later", "USER_SYNC sync1"):
        with pytest.raises(CommandParseError, match="USER_SYNC"):
            mine.parse(bad)


def test_registration_refuses_clashes_and_bad_names() -> None:
    @dataclass(frozen=True)
    class Clash:
        NAME: ClassVar[str] = "PING"

        @classmethod
        def from_args(cls, args: str) -> Any:
            return cls()

        def to_args(self) -> str:
            return ""

    with pytest.raises(ValueError, match="registered already"):
        CommandSet([Clash])

    class Lower(Clash):
        NAME: ClassVar[str] = "lower"

    with pytest.raises(ValueError, match="capitals"):
        CommandSet([Lower])


@given(commands, names)
def test_rows_of_an_instance_are_told_without_parsing_as_parsing_tells_them(
    command: Command, instance: str
) -> None:
    line = to_line(command)
    parsed = COMMANDS.parse(line)
    expected = isinstance(parsed, Rdata | Position) and parsed.instance == instance
    assert rows_of(line, instance) is expected
    assert rows_of(line.encode(), instance.encode()) is expected
    # The name of the command's own instance, and one that only starts or ends like it.
    if isinstance(command, Rdata | Position):
        assert rows_of(line, command.instance)
        assert not rows_of(line, command.instance[:-1] or "x" + command.instance)
        assert rows_of(line.encode(), command.instance.encode())


def test_rows_of_refuses_to_mix_text_and_bytes() -> None:
    with pytest.raises(TypeError, match="both be str, or both bytes"):
        rows_of("RDATA s a 1 {}", b"a")  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "line", ["NAME \ud800", 'RDATA s w 1 "\udfff"', "POSITION s w\ud800 1 2", "PING \ud83d"]
)
def test_a_lone_surrogate_is_refused_not_parsed(line: str) -> None:
    """No UTF-8 line carries one, and a command holding one could not be sent on
    (`to_line` failed with UnicodeEncodeError; Hypothesis found it in a presence name)."""
    with pytest.raises(CommandParseError, match="lone surrogate"):
        CommandSet().parse(line)
