"""Every parser of outside input, fuzzed: Spark offsets and source options, config
mappings and files, the internal HTTP API's and the demo's request bodies and query
parameters, sync tokens, presence commands, peers' metrics text and stored stream
records. Each gives a valid value or its one documented error, with a message, and
returns promptly: never another exception, a 500, or a hang (R-OP-4).

Each strategy mixes hostile input with valid input and valid input slightly spoiled, so
that both the refusals and the checks on what was accepted run. Wire commands and token
text have their own fuzz tests (test_commands, test_tokens).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, AnyStr, TypeVar
from urllib.parse import quote

import aiohttp
import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import pace
from demo_helpers import chat, post
from http_api_helpers import SECRET, Counter, MemoryStream, StartApi, raw_request
from pace import scaled
from plait import ConfigError, Database, StreamSpec, StreamToken, TableSpec
from plait.caches.invalidations import InvalidationRows
from plait.config import MAX_CONFIG_BYTES, InstanceConfig
from plait.core import offsets
from plait.core.commands import CommandSet, to_line
from plait.demo import api_requests, presence
from plait.demo import tokens as sync_tokens
from plait.errors import CommandParseError, TokenParseError
from plait.ops.status import pending_ages, scrape
from plait.replication.http_api import PREFIX
from plait.replication.http_server import InternalApi
from plait.replication.metrics import OLDEST_UNFINISHED_AGE
from plait.spark.options import Options
from plait.spark.plan import Plan
from token_strategies import tokens

T = TypeVar("T")
E = TypeVar("E", bound=Exception)


def outcome(parse: Callable[[], T], error: type[E]) -> T | E:
    """What `parse()` returned, or the `error` it raised (any other exception fails
    the test)."""
    try:
        return parse()
    except error as err:
        return err


# -- strategies ----------------------------------------------------------------------

# Text as it arrives from outside: any code point, lone surrogates and NULs included.
any_text = st.text(st.characters(exclude_categories=()), max_size=60)
names = st.text(min_size=1, max_size=8)
integers = st.one_of(
    st.integers(-5, 50),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**63 - 1, 2**63, -(2**63)]),
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    integers,
    st.floats(),  # NaN and infinities too: Python's json module writes and reads them
    any_text,
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12,
)
# Fragments that make text look almost like what a parser expects.
digits = st.sampled_from(
    ["0", "1", "7", "42", "01", "-1", "\u00b2", "\u0661", "\u0663", "9" * 25, "1_0", " 1"]
)
# Valid names of several kinds.
sql_names = st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True)
writers = st.sampled_from(["w1", "w2", "master"])
WRITER_IDS = {"w1": 1, "w2": 2, "w7": 7}


def mostly(valid: st.SearchStrategy[T], hostile: st.SearchStrategy[T]) -> st.SearchStrategy[T]:
    """`valid`, but one time in four `hostile`."""
    return st.integers(0, 3).flatmap(lambda n: hostile if n == 0 else valid)


@st.composite
def _edited(draw: st.DrawFn, valid: st.SearchStrategy[str], piece: st.SearchStrategy[str]) -> str:
    text = draw(valid)
    for _ in range(draw(st.integers(0, 3))):
        start = draw(st.integers(0, len(text)))
        end = draw(st.integers(start, min(len(text), start + 3)))
        text = text[:start] + draw(piece) + text[end:]
    return text


def near(*fragments: str, valid: st.SearchStrategy[str] | None = None) -> st.SearchStrategy[str]:
    """Text glued from `fragments`, digits and a little noise; and, given `valid` ones,
    valid texts as they are or with a few short stretches replaced by such pieces."""
    piece = st.sampled_from(fragments) | digits | st.text(max_size=2)
    glued = st.lists(piece, max_size=12).map("".join)
    return glued if valid is None else glued | _edited(valid, piece)


@st.composite
def tampered(
    draw: st.DrawFn,
    valid: st.SearchStrategy[Any],
    keys: list[str],
    values: st.SearchStrategy[Any] = json_values,
) -> Any:
    """A `valid` JSON value as it is, or with up to two of the values in it (at any
    depth) replaced by `values`, dropped, or added (under one of `keys`, or any key)."""
    value = copy.deepcopy(draw(valid))
    for _ in range(draw(st.integers(0, 2))):
        parent = value
        while isinstance(parent, dict | list) and draw(st.booleans()):
            inside = parent.values() if isinstance(parent, dict) else parent
            children = [c for c in inside if isinstance(c, dict | list)]
            if not children:
                break
            parent = draw(st.sampled_from(children))
        if isinstance(parent, dict):
            key = draw(st.sampled_from([*parent, *keys]) | any_text)
            if key in parent and draw(st.integers(0, 2)) == 0:
                del parent[key]
            else:
                parent[key] = draw(values)
        elif isinstance(parent, list) and parent and draw(st.booleans()):
            parent[draw(st.integers(0, len(parent) - 1))] = draw(values)
        elif isinstance(parent, list):
            parent.append(draw(values))
        else:
            value = draw(values)
    return value


def deep(opening: AnyStr, depth: int = 100_000) -> AnyStr:
    """Nesting far past Python's recursion limit."""
    return opening * depth


def token_texts(ids: dict[str, int] = WRITER_IDS) -> st.SearchStrategy[str]:
    """Stream tokens' text forms (`s5`, `m5~1.9~2.7`), their writers by the ids in `ids`."""
    return tokens(names=st.sampled_from(sorted(ids))).map(lambda t: t.encode_text(ids))


# -- Spark offsets and source options ------------------------------------------------------

# An offset as Spark hands it back: JSON text, a valid one or one almost like it. (The
# dict form goes straight to StreamToken.from_json_dict: test_tokens fuzzes that.)
offset_texts = (
    any_text
    | near(
        '{"min":',
        '"writers":',
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        '"w"',
        "NaN",
        "1e999",
        valid=tokens(names=names).map(offsets.to_json),
    )
    | (
        json_values
        | tampered(tokens(names=names).map(StreamToken.to_json_dict), ["min", "writers", "Min"])
    ).map(json.dumps)
)


@settings(max_examples=300)
@given(offset_texts)
@example(deep("["))
@example('{"min": ' + deep("[") + "}")
@example('{"min": 1, "writers": ' + deep('{"a":'))
@example('{"min": NaN}')
@example('{"min": Infinity, "writers": {}}')
@example('{"min": 1' + "0" * 5000 + "}")
@example('{"min": 1, "writers": {"w": 1e400}}')
def test_offset_texts_parse_or_are_refused(text: str) -> None:
    """A valid offset round-trips through its canonical text; anything else is a
    TokenParseError with a message."""
    token = outcome(lambda: offsets.from_json(text), TokenParseError)
    if isinstance(token, TokenParseError):
        assert str(token)
        return
    assert offsets.from_json(offsets.to_json(token)) == token


class _Catalog:
    """Stands in for the catalog connection: instance ids 1 and 2 are w1 and w2, the
    sequence has handed out every ID (no token is past its head), and no table holds
    rows of writers the spec does not list."""

    def execute(self, query: Any, params: Any = None) -> _Catalog:
        return self

    def fetchall(self) -> list[tuple[int, str]]:
        return [(1, "w1"), (2, "w2")]

    def fetchone(self) -> tuple[int, bool]:
        return (2**63 - 1, True)

    def __iter__(self) -> Iterator[tuple[str]]:
        return iter([])


def _ask(work: Callable[[Any], Any]) -> Any:
    return work(_Catalog())


PLAN = Plan(
    Options.parse({"dsn": "postgresql:///none", "stream": "events"}),
    StreamSpec("events", tables=[TableSpec("events")], writers=["w1", "w2"]),
    TableSpec("events"),
    (),
    offsets.Identity("events", "u1"),
)


@settings(max_examples=300)
@given(
    any_text
    | near(
        "s",
        "m",
        "~",
        ".",
        "1.",
        "2.",
        "earliest",
        " ",
        '{"min":',
        "}",
        '"writers":{"w1":',
        # Text forms naming ids 1, 2 (w1, w2) and 7 (which the catalog does not know).
        valid=st.just("earliest") | token_texts() | tokens().map(offsets.to_json),
    )
)
@example(" earliest ")
@example("m3~1.5~2.9")
@example("m3~1.5~7.9")  # an instance id the catalog does not know
@example("{" + deep("["))
def test_spark_start_and_end_tokens_parse_or_are_refused(text: str) -> None:
    if text.strip() == "latest":
        return  # asks the database
    token = outcome(lambda: PLAN.token(text, "startToken", _ask), ConfigError)
    if isinstance(token, ConfigError):
        assert "startToken" in str(token)
        return
    assert isinstance(token, StreamToken)
    if not text.strip().startswith("{"):
        assert set(token.writers) <= {"w1", "w2"}  # ids named by the catalog only


OPTION_NAMES = [
    "dsn",
    "stream",
    "table",
    "startingToken",
    "maxRowsPerTrigger",
    "maxIdsPerPartition",
    "partitioning",
    "DSN",
]
option_values = st.sampled_from(["", "0", "-1", "5", "x", "writers", "SLICES", "1" * 5000])
valid_options = st.fixed_dictionaries(
    {"dsn": st.just("postgresql:///x"), "stream": st.just("events")},
    optional={
        "table": sql_names,
        "startingToken": st.just("earliest") | token_texts(),
        "maxRowsPerTrigger": st.integers(1, 10**6).map(str),
        "maxIdsPerPartition": st.integers(1, 10**6).map(str),
        "partitioning": st.sampled_from(["slices", "writers", "Writers"]),
    },
)


@settings(max_examples=300)
@given(
    st.dictionaries(st.sampled_from(OPTION_NAMES) | any_text, option_values | any_text, max_size=6)
    | tampered(valid_options, OPTION_NAMES, option_values | any_text)
)
def test_spark_source_options_parse_or_are_refused(raw: dict[str, str]) -> None:
    options = outcome(lambda: Options.parse(raw), ConfigError)
    if isinstance(options, ConfigError):
        assert str(options).startswith("plait source:")
        return
    assert options.dsn
    assert options.stream
    assert options.max_ids >= 1
    assert options.max_rows is None or options.max_rows >= 1
    # A number given is read as the ASCII digits it is written in, nothing else.
    given = {k.lower(): v for k, v in raw.items()}
    numbers = {"maxrowspertrigger": options.max_rows, "maxidsperpartition": options.max_ids}
    for key, number in numbers.items():
        if key in given:
            text = given[key].strip()
            assert text.isascii(), text
            assert text.isdigit(), text
            assert number == int(text)


@pytest.mark.parametrize("value", ["\u0661\u0662", "1_000", "+5", "0", "1e3", " ", "5.0"])
def test_spark_int_options_take_ascii_digits_only(value: str) -> None:
    raw = {"dsn": "postgresql:///x", "stream": "events", "maxRowsPerTrigger": value}
    with pytest.raises(ConfigError, match="must be a positive integer"):
        Options.parse(raw)
    assert Options.parse({**raw, "maxRowsPerTrigger": " 012 "}).max_rows == 12


# -- configuration ---------------------------------------------------------------------

CONFIG_KEYS = [
    "instance_name",
    "deployment",
    "database",
    "streams",
    "instance_map",
    "replication",
    "http",
    "caches",
    "position_flush_interval",
    "fence_after",
    # ...and one level down
    "name",
    "kind",
    "tables",
    "writers",
    "sequence",
    "backwards",
    "transport",
    "tcp",
    "redis",
    "url",
    "secret",
    "port",
    "enabled",
    "hub",
]


def valid_configs() -> st.SearchStrategy[dict[str, Any]]:
    table = st.fixed_dictionaries({"name": sql_names}, optional={"id_column": st.just("id")})
    stored: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
        {
            "name": sql_names,
            "tables": st.lists(table, min_size=1, max_size=2, unique_by=lambda t: t["name"]),
        },
        optional={
            "writers": st.lists(writers, unique=True, max_size=2),
            "sequence": sql_names,
            "backwards": st.booleans(),
        },
    )
    memory = st.fixed_dictionaries(
        {
            "name": sql_names,
            "kind": st.just("memory"),
            "writers": st.lists(writers, min_size=1, max_size=2, unique=True),
        }
    )
    replication = st.sampled_from(
        [
            {"transport": "none"},
            {"transport": "tcp", "tcp": {"hub": "w1", "port": 9093}},
            {"transport": "redis", "redis": {"url": "redis://127.0.0.1:6379/0", "password": "p"}},
        ]
    )
    return st.fixed_dictionaries(
        {"instance_name": writers},
        optional={
            "deployment": writers,
            "database": st.just("postgresql:///plait"),
            "streams": st.lists(stored | memory, max_size=3, unique_by=lambda s: s["name"]),
            "instance_map": st.dictionaries(writers, st.just("http://127.0.0.1:8081"), max_size=2),
            "replication": replication,
            "http": st.fixed_dictionaries(
                {}, optional={"port": st.integers(0, 65535), "secret": st.just("s3cret")}
            ),
            "caches": st.fixed_dictionaries({}, optional={"enabled": st.booleans()}),
            "position_flush_interval": st.floats(0.01, 60),
            "fence_after": st.none() | st.floats(0.01, 60),
        },
    )


def check_config(load: Callable[[], InstanceConfig]) -> None:
    """A valid config (that loads again as it is), or a ConfigError with a message of
    bounded size."""
    config = outcome(load, ConfigError)
    if isinstance(config, ConfigError):
        assert 0 < len(str(config)) < 5000
        return
    assert InstanceConfig.load(config.model_dump()) == config


@settings(max_examples=200)
@given(json_values | tampered(valid_configs(), CONFIG_KEYS))
def test_config_mappings_load_or_are_refused(value: Any) -> None:
    check_config(lambda: InstanceConfig.load(value))


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a test writes the configuration file it loads (one per module: Hypothesis
    examples overwrite it)."""
    return tmp_path_factory.mktemp("config") / "plait.yaml"


YAML_PIECES = [
    "instance_name: w\n",
    "streams:\n",
    "  - name: s\n",
    "    tables: [{name: t}]\n",
    "- ",
    ": ",
    "\n",
    "  ",
    "[",
    "]",
    "{",
    "}",
    ",",
    "&a ",
    "*a",
    "<<: ",
    "? ",
    "!!timestamp ",
    "!!int ",
    "!!float ",
    "!!bool ",
    "!!binary ",
    "!!set ",
    "!!omap ",
    "!!python/object:os.system ",
    "!custom ",
    "2020-13-45",
    "2020-02-30 25:61:00",
    "0x",
    "0o9",
    ".inf",
    "~",
    "'",
    '"',
    "\\",
    "#",
    "---\n",
    "...\n",
    "%YAML 1.1\n",
    "\t",
    "\x00",
    "\ufeff",
]


def check_config_file(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    started = time.process_time()  # the CPU it took: a busy machine gives it less often
    check_config(lambda: InstanceConfig.from_yaml(path))
    assert time.process_time() - started < 5


@settings(max_examples=400, deadline=None)
@given(near(*YAML_PIECES, valid=valid_configs().map(yaml.safe_dump)))
@example("a: !!timestamp 2020-13-45")
@example("a: 2020-02-30")
@example("a: !!timestamp nope")
@example("a: !!int x")
@example("a: !!bool maybe")
@example("a: !!float .")
@example("a: !!int " + "9" * 5000)
@example(deep("["))
@example(deep("- "))
@example(deep("{a: "))
@example("instance_name: w\ninstance_map: &a {x: *a}\n")
@example("- &a [*a]")
def test_config_files_load_or_are_refused(config_file: Path, text: str) -> None:
    check_config_file(config_file, text.encode("utf-8", "surrogatepass"))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
@example(b"instance_name: \xff\xfe")
@example("instance_name: w".encode("utf-16"))
@example(b"\xef\xbb\xbfinstance_name: w")
def test_config_files_of_any_bytes_load_or_are_refused(config_file: Path, data: bytes) -> None:
    check_config_file(config_file, data)


def _loop_of(kind: type) -> Any:
    """A list or dict that holds itself (what a recursive YAML alias gives)."""
    if kind is list:
        items: list[Any] = []
        items.append(items)
        return {"instance_name": "w", "streams": items}
    mapping: dict[str, Any] = {"instance_name": "w"}
    mapping["instance_map"] = mapping
    return mapping


def _alias_bomb(count: int) -> str:
    """`count` streams, each with the same `count` tables, all by alias: a few KB of
    YAML that expands to count**2 values."""
    tables = ", ".join(["*t"] * count)
    streams = ", ".join(["*s"] * count)
    return (
        "instance_name: w\n"
        "t: &t {name: 'bad name'}\n"
        f"tl: &tl [{tables}]\n"
        "s: &s {name: s, tables: *tl}\n"
        f"streams: [{streams}]\n"
    )


def _billion_laughs() -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return "instance_name: w\n" + "\n".join(lines) + "\nstreams: *a9\ninstance_map: {x: *a9}\n"


@pytest.mark.parametrize(
    "value",
    [
        _loop_of(list),
        _loop_of(dict),
        {"instance_name": "w", "streams": [{"name": "s", "tables": [[]] * 200_000}]},
        {"instance_name": "w", "instance_map": {str(i): str(i) for i in range(200_000)}},
        _alias_bomb(3000),
        _billion_laughs(),
        "instance_name: w\nx: " + "a" * (MAX_CONFIG_BYTES + 1),
    ],
    ids=[
        "list-loop",
        "dict-loop",
        "many-tables",
        "huge-map",
        "alias-bomb",
        "billion-laughs",
        "oversized",
    ],
)
def test_configs_that_hold_themselves_or_too_much_are_refused_quickly(
    config_file: Path, value: Any
) -> None:
    """Mappings as given, text as a file."""
    load: Callable[[Any], InstanceConfig] = InstanceConfig.load
    if isinstance(value, str):
        config_file.write_text(value)
        load, value = InstanceConfig.from_yaml, config_file
    started = time.process_time()  # the CPU it took: a busy machine gives it less often
    with pytest.raises(ConfigError) as info:
        load(value)
    assert time.process_time() - started < 2
    assert len(str(info.value)) < 5000


def test_a_config_file_error_does_not_echo_the_file(config_file: Path) -> None:
    """YAML error messages quote the offending line; a secret on it would reach the
    logs of a process that failed to start."""
    config_file.write_bytes(b"instance_name: w\nhttp: {secret: hunter2: oops}\n")
    with pytest.raises(ConfigError, match="line 2") as info:
        InstanceConfig.from_yaml(config_file)
    assert "hunter2" not in str(info.value)


# -- stored stream records (plait_streams rows) -----------------------------------------

stream_records = st.builds(
    StreamSpec,
    name=sql_names,
    tables=st.lists(
        st.builds(TableSpec, sql_names), min_size=1, max_size=2, unique_by=lambda t: t.name
    ),
    writers=st.lists(writers, unique=True, max_size=2),
    backwards=st.booleans(),
).map(StreamSpec.to_json)
RECORD_KEYS = ["name", "sequence", "backwards", "writers", "tables", "id_column", "other"]


@settings(max_examples=300)
@given(json_values | tampered(stream_records, RECORD_KEYS, names | json_values))
@example({"name": "s", "sequence": "s_seq", "writers": None, "tables": [{"name": "t"}]})
@example({"name": "s", "sequence": "s_seq", "writers": [], "tables": None})
@example({"name": "s", "sequence": "s_seq", "tables": [{"name": "t", "bogus": 1}]})
def test_stored_stream_records_load_or_are_refused(value: Any) -> None:
    spec = outcome(lambda: StreamSpec.from_json(value), ConfigError)
    if isinstance(spec, ConfigError):
        assert str(spec)
        return
    assert StreamSpec.from_json(spec.to_json()) == spec


# -- the demo's sync tokens and presence commands ------------------------------------------


def sync_token_texts(ids: dict[str, int] = WRITER_IDS) -> st.SearchStrategy[str]:
    return st.builds(
        "{}_{}_t{}".format,
        token_texts(ids),
        token_texts(ids),
        st.integers(0, 50) | st.just(10**19 - 1),
    )


@settings(max_examples=400)
@given(any_text | near("s", "m", "_", "t", "~", ".", "1.", "_t", valid=sync_token_texts()))
@example("s1_s1_t\u00b2")  # "²": str.isdigit() says yes, int() says no
@example("s1_s1_t\u0661")
@example("s1_s1_t" + "9" * 25)
def test_sync_tokens_parse_or_are_refused(text: str) -> None:
    parsed = outcome(lambda: sync_tokens.parse(text), TokenParseError)
    if isinstance(parsed, TokenParseError):
        assert str(parsed).startswith("sync token")
        return
    token = sync_tokens.resolve(parsed, {i: f"w{i}" for i in sync_tokens.writer_ids(parsed)})
    ids = {f"w{i}": i for i in sync_tokens.writer_ids(parsed)}
    assert sync_tokens.parse(token.encode(ids)) == sync_tokens.Parsed(
        token.encode(ids), parsed.events, parsed.account_data, parsed.typing
    )


PRESENCE = CommandSet([presence.UserSync, presence.ClearUserSync])
users = st.sampled_from(["@alice:x", "bob", "k\u00e9y"])
presence_lines = st.one_of(
    st.builds(
        presence.UserSync,
        st.just("sync1"),
        users,
        st.sampled_from(["start", "end"]),
        st.integers(0, 2**63 - 1),
    ),
    st.builds(presence.ClearUserSync, st.just("sync1")),
).map(to_line)


@settings(max_examples=300)
@given(
    st.tuples(st.sampled_from(["USER_SYNC", "CLEAR_USER_SYNC"]), any_text).map(" ".join)
    | near(
        "USER_SYNC ", "sync1", " ", "@alice:x", "start", "end", "\x00", "\t", valid=presence_lines
    )
)
def test_presence_commands_parse_or_are_refused(line: str) -> None:
    command = outcome(lambda: PRESENCE.parse(line), CommandParseError)
    if isinstance(command, CommandParseError):
        assert str(command)
        return
    assert PRESENCE.parse(to_line(command)) == command


@settings(max_examples=300)
@given(any_text)
@example("\x00")
@example("a\x7fb")
@example("\ud800")
@example("a\u2028b")
def test_user_ids_are_ones_a_command_line_and_the_database_can_carry(user: str) -> None:
    if isinstance(outcome(lambda: presence.check_user(user), CommandParseError), Exception):
        return
    assert user.isprintable()
    user.encode()  # no lone surrogate: PostgreSQL takes it
    line = presence.UserSync("sync1", user, "start", 1)
    assert PRESENCE.parse(to_line(line)) == line


# -- peers' /metrics text ----------------------------------------------------------------

AGE = OLDEST_UNFINISHED_AGE


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


label_values = st.sampled_from(["s", "w", "", 'a"b', "a\\b", "a\nb", "\u00e9"])
sample_values = st.one_of(
    st.sampled_from(["0", "2.5", "1e3", "-3", "NaN", "+Inf"]),
    st.floats(min_value=0, allow_infinity=False).map(repr),
    st.floats().map(repr),
)


@st.composite
def metrics_texts(draw: st.DrawFn) -> str:
    """What an instance's /metrics says: ages (any number, NaN and negative ones too)
    and other metrics, labelled by stream and writer (and more, or less)."""
    lines = [f"# HELP {AGE} Seconds.", f"# TYPE {AGE} gauge"] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from([AGE, AGE, "plait_stream_position"]))
        labels = draw(st.permutations(["stream", "writer", "instance"]))
        labels = labels[: draw(st.sampled_from([3, 3, 2, 1]))]
        pairs = ",".join(f'{key}="{_label(draw(label_values))}"' for key in labels)
        lines.append(f"{name}{{{pairs}}} {draw(sample_values)}")
    return "\n".join(lines) + "\n"


@settings(max_examples=400)
@given(
    any_text
    | near(
        "# TYPE ",
        "# HELP ",
        AGE,
        " gauge",
        "\n",
        "{",
        "}",
        'stream="s"',
        'writer="w"',
        ",",
        "=",
        '"',
        " ",
        "1.5",
        "NaN",
        "+Inf",
        "# EOF",
        "\\",
        valid=metrics_texts(),
    )
)
@example(f'# TYPE {AGE} gauge\n{AGE}{{stream="s",writer="w"}} 2.5\n')
@example(f'{AGE}{{stream="s",writer="w"}} NaN\n')
@example(f'{AGE}{{stream="s",writer="w"}} -3\n')
@example(f'{AGE}{{stream="s",writer="w"}} 2\n')  # an integer, as a peer may write it
@example(f'{AGE}{{stream="s",writer="w"}} 1{"0" * 400}\n')  # an int no float can hold
@example("# TYPE a")
def test_metrics_text_parses_or_is_refused(text: str) -> None:
    ages = outcome(lambda: pending_ages(text), ValueError)
    if isinstance(ages, ValueError):
        return
    assert all(isinstance(age, float) and math.isfinite(age) and age >= 0 for age in ages.values())


@contextlib.contextmanager
def _answering(reply: bytes) -> Iterator[str]:
    """The URL of a server that answers every connection with `reply`, as it is."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.05)
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        server.close()


@pytest.mark.parametrize(
    "reply",
    [
        b"hello\r\n",  # not HTTP: a Redis port in the instance map, say
        b"",
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 200 + b"\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n\xff\xfe\x00ab",
        b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n",
    ],
    ids=["not-http", "hang-up", "cut-short", "many-headers", "binary", "500"],
)
def test_an_instance_that_answers_garbage_is_reported_not_a_crash(reply: bytes) -> None:
    with _answering(reply) as url:
        ages, failed = scrape({"peer": url}, timeout=5)
    assert ages == {}
    assert failed["peer"]


# -- cache invalidations from peers and stored rows ---------------------------------------


@settings(max_examples=300)
@given(json_values | st.tuples(any_text, json_values).map(list))
@example(["room_members", [{"a": 1}]])
@example(["room_members", [[1, [2, "x"]]]])
def test_invalidation_rows_parse_or_are_refused(value: Any) -> None:
    row = outcome(lambda: InvalidationRows().from_json(value), ValueError)
    if isinstance(row, ValueError):
        return
    assert row.keys is None or isinstance(row.keys, tuple)
    hash(row.keys)  # a cache can look it up (an unhashable key: every entry is dropped)


# -- the internal HTTP API ----------------------------------------------------------------

HTTP_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
AUTH = {"Authorization": f"Bearer {SECRET}"}


@pytest.fixture
def typing_rows() -> MemoryStream:
    return MemoryStream("typing", {token: {"n": token} for token in range(1, 6)})


@pytest.fixture
async def api(
    start_api: StartApi,
    typing_rows: MemoryStream,
) -> InternalApi:
    """An internal API with a secret, one in-memory stream and an echo endpoint."""
    server = await start_api(secret=SECRET, catch_up=typing_rows)
    server.register("echo", Counter())
    return server


@pytest.fixture
def answered() -> dict[tuple[str, str], Any]:
    """The result of the first call the `api` answered, by (caller, txn id): it answers
    every retry with the same txn id the same way."""
    return {}


async def _answer(response: aiohttp.ClientResponse) -> tuple[int, Any]:
    """The status and JSON body of an answer, which must be JSON whatever happened."""
    raw = await response.read()
    assert response.content_type == "application/json", raw[:200]
    return response.status, json.loads(raw)


def _assert_clear(status: int, body: Any, allowed: set[int]) -> None:
    assert status in allowed, (status, body)
    if status >= 400:
        assert isinstance(body, dict)
        assert isinstance(body.get("error"), str)
        assert body["error"]


def _segment(text: str) -> str:
    """`text` as one URL path segment; a lone surrogate becomes bytes that are not
    UTF-8, which a client may send as well."""
    return quote(text, safe="", errors="surrogatepass")


def _body_bytes(value: Any) -> bytes:
    return json.dumps(value).encode("utf-8", "surrogatepass")


call_bodies = st.fixed_dictionaries(
    {
        # Few callers and txn ids: calls repeat one, as retries do.
        "caller": st.sampled_from(["c", "d"]),
        "positions": st.dictionaries(names, st.integers(0, 2**63 - 1), max_size=2),
        "args": json_values,
    }
)


@HTTP_SETTINGS
@given(
    name=mostly(st.just("echo"), st.sampled_from(["missing", "\udcff"]) | any_text),
    txn=mostly(
        st.sampled_from(["t1", "t2", "a" * 128]),
        st.sampled_from(["a" * 129, ".", "x/y"]) | any_text,
    ),
    body=mostly(
        call_bodies.map(_body_bytes),
        tampered(call_bodies, ["caller", "positions", "args"]).map(_body_bytes)
        | json_values.map(_body_bytes)
        | st.binary(max_size=100),
    ),
)
@example(body=deep(b"["), name="echo", txn="t1")
@example(body=b'{"caller": "c", "positions": {}, "args": NaN}', name="echo", txn="t1")
@example(body=b'{"caller": "c", "positions": {}, "args": ["\\ud800"]}', name="echo", txn="t1")
@example(body=b'{"caller": "c", "positions": {"s": 1e400}, "args": 1}', name="echo", txn="t1")
async def test_internal_calls_answer_or_refuse_clearly(
    api: InternalApi,
    http: aiohttp.ClientSession,
    answered: dict[tuple[str, str], Any],
    body: bytes,
    name: str,
    txn: str,
) -> None:
    url = f"{api.url}{PREFIX}/call/{_segment(name)}/{_segment(txn)}"
    async with http.post(url, data=body, headers=AUTH) as response:
        status, answer = await _answer(response)
    event(f"status {status}")
    _assert_clear(status, answer, {200, 400, 404, 405})
    if status == 200:
        # This call's answer, or the one of the first call with its caller and txn id.
        sent = json.loads(body)
        first = answered.setdefault((sent["caller"], txn), answer["result"])
        assert answer["result"] == first
        if first is answer["result"]:
            assert first["echo"] == sent["args"]


bounds = st.integers(-2, 12).map(str) | st.sampled_from(["-0", "10000"])


@HTTP_SETTINGS
@given(
    stream=mostly(st.just("typing"), st.sampled_from(["events", "\ud800"]) | any_text),
    query=tampered(
        st.fixed_dictionaries({"from": bounds, "to": bounds, "limit": bounds}),
        ["from", "to", "limit"],
        st.sampled_from(["10001", "1" * 30, "\u0663", " 1", "01", "1.5", ""]) | any_text,
    ),
)
async def test_catch_up_pages_answer_or_refuse_clearly(
    api: InternalApi,
    typing_rows: MemoryStream,
    http: aiohttp.ClientSession,
    stream: str,
    query: dict[str, str],
) -> None:
    url = f"{api.url}{PREFIX}/streams/{_segment(stream)}/updates"
    async with http.get(url, params=query, headers=AUTH) as response:
        status, answer = await _answer(response)
    event(f"status {status}")
    _assert_clear(status, answer, {200, 400, 404})
    if status == 200:
        # The query as the source was asked it (ASCII integers only), and its page whole.
        asked = ("typing", *(int(query[key]) for key in ("from", "to", "limit")))
        assert all(re.fullmatch("-?[0-9]+", query[key]) for key in ("from", "to", "limit"))
        assert typing_rows.asked[-1] == asked
        page = dataclasses.asdict(await typing_rows(*asked))
        assert answer == json.loads(json.dumps(page))


def _call_with(authorization: bytes) -> bytes:
    """A call with the header bytes as they are (no client library would send them)."""
    body = b'{"caller": "c", "positions": {}, "args": 1}'
    return (
        f"POST {PREFIX}/call/echo/t1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
        + b"Authorization: "
        + authorization.replace(b"\r", b"").replace(b"\n", b"")
        + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


@HTTP_SETTINGS
@given(
    header=st.binary(max_size=40)
    | st.sampled_from([b"Bearer", b"Bearer " + SECRET.encode(), b"bearer  " + SECRET.encode()])
    | st.binary(max_size=4).map(lambda noise: b"Bearer " + SECRET.encode() + noise)
)
async def test_any_authorization_header_is_let_in_or_refused_with_a_401(
    api: InternalApi, header: bytes
) -> None:
    async with pace.within(10, "the API's answer to a call with this Authorization header"):
        status, body = await raw_request(api.port, _call_with(header))
    if SECRET.encode() not in header:
        assert status in (400, 401), body  # 400: aiohttp refuses some header bytes itself
    elif header == f"Bearer {SECRET}".encode():
        assert status == 200, body
    else:
        assert status in (200, 400, 401), body


# -- the demo's public HTTP API ---------------------------------------------------------

ROUTES = {
    "/send": "send_message",
    "/membership": "set_membership",
    "/account_data": "set_account_data",
    "/tags": "set_tag",
    "/typing": "set_typing",
    "/backfill": "backfill",
}
ROOMS = ["!room1:demo", "!room2:demo"]
# A request may wait for positions (up to 5 s): more than the `http` fixture allows.
DEMO_TIMEOUT = aiohttp.ClientTimeout(total=10)
hostile_text = st.sampled_from(["", "a b", "\x00", "a\x00b", "\ud800", "\x7f"]) | any_text
hostile = hostile_text | json_values
# What each kind of field takes (api_requests.BODIES), mostly valid: the write then
# reaches the instance that owns it, where anything the check let through must work.
valid: dict[str, st.SearchStrategy[Any]] = {
    "id": st.sampled_from([*ROOMS, "alice", "bob", "@carol:demo", "k\u00e9y"]),
    "text": st.sampled_from(["hello", "", "two\nlines", "\u00e9\U0001f600"]) | st.text(max_size=20),
    "json": st.recursive(
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=10),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
        ),
        max_leaves=8,
    ),
    "flag": st.booleans(),
    "membership": st.sampled_from(["join", "leave"]),
}
# Sync tokens, valid or nearly (one naming an id the demo's instance_map lacks: a 400).
sync_tokens_text = st.sampled_from(
    ["s0_s0_t0", "s3_s1_t0", "s999999_s0_t0", "m0~1.5_s0_t0", "s0_m0~2.999_t7", "s0_s0_t999999"]
) | near("s", "m", "~", ".", "_", "t", "1.", "m0~", valid=sync_token_texts())


def public_bodies(endpoint: str) -> st.SearchStrategy[bytes]:
    """Bodies shaped like `endpoint`'s: its fields with valid values (the optional
    ones now and then), or with one or two left out, added, or hostile."""
    required, optional = api_requests.BODIES[endpoint]
    bodies = st.fixed_dictionaries(
        {field: valid[kind] for field, kind in required.items()},
        optional={field: valid[kind] for field, kind in optional.items()},
    )
    return tampered(bodies, [*required, *optional], hostile).map(_body_bytes)


@st.composite
def public_requests(draw: st.DrawFn) -> tuple[str, str, dict[str, str], bytes | None]:
    """(method, path, query, body) of a request to a sync worker's public API."""
    kind = draw(st.sampled_from(["post", "post", "post", "sync", "backfill"]))
    if kind == "post":
        path = draw(st.sampled_from(sorted(ROUTES)))
        body = draw(
            public_bodies(ROUTES[path]) | json_values.map(_body_bytes) | st.binary(max_size=60)
        )
        return "POST", path, {}, body
    query_keys = {
        "sync": ["user", "since", "after", "timeout"],
        "backfill": ["room", "since"],
    }[kind]
    values: dict[str, st.SearchStrategy[str]] = {
        "user": valid["id"] | hostile_text,
        "room": valid["id"] | hostile_text,
        "since": sync_tokens_text
        if kind == "sync"
        else near("s", "m", "~", ".", "1.", valid=token_texts({"w1": 1, "w2": 2})),
        "after": sync_tokens_text,
        # Short long-polls only: a valid timeout holds the request that long.
        "timeout": st.sampled_from(["0", "20", "-5", "x", "", "1e3", "0x10"]),
    }
    query = {key: draw(values[key]) for key in query_keys if draw(st.integers(0, 3))}
    return "GET", f"/{kind}", query, None


@pytest.fixture
async def demo(db: Database) -> AsyncIterator[str]:
    """The demo deployment; yields a sync worker's public URL."""
    async with chat(db) as url:
        yield url


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=public_requests())
@example(request=("POST", "/send", {}, deep(b"[")))
@example(request=("POST", "/send", {}, b'{"room": "!r", "sender": "a", "body": NaN}'))
@example(request=("POST", "/send", {}, b'{"room": "!r", "sender": "a"}'))
@example(request=("POST", "/send", {}, b'{"room": "!r", "sender": "a", "body": "\\u0000"}'))
@example(
    request=("POST", "/tags", {}, b'{"room": "!r", "user": "a", "tag": "t", "content": 1e400}')
)
@example(request=("POST", "/membership", {}, b'{"room": "!r", "user": "a", "membership": "x"}'))
@example(request=("GET", "/sync", {"user": "a\x00"}, None))
@example(request=("GET", "/sync", {"user": "a", "since": "s1_s1_t\u00b2"}, None))
@example(request=("GET", "/backfill", {"room": "a\x00"}, None))
@example(request=("GET", "/backfill", {"room": "a", "since": "m0~9999999999999999999.1"}, None))
async def test_the_demo_api_answers_or_refuses_clearly(
    demo: str,
    http: aiohttp.ClientSession,
    request: tuple[str, str, dict[str, str], bytes | None],
) -> None:
    method, path, query, body = request
    started = time.monotonic()
    async with http.request(
        method, demo + path, params=query, data=body, timeout=DEMO_TIMEOUT
    ) as response:
        status, answer = await _answer(response)
    event(f"{method} {path} {status} {str(answer.get('error'))[:60] if status != 200 else ''}")
    _assert_clear(status, answer, {200, 400})
    # one position wait (5 s) at most, never a hang
    assert time.monotonic() - started < 5 + scaled(1)


async def test_an_after_token_from_the_future_is_clamped_not_waited_on(
    demo: str,
    http: aiohttp.ClientSession,
) -> None:
    """`/sync?after=` waits for the writes its token names; positions no writer has
    reached are clamped to what was handed out, and the writers are waited on together
    (each wait used to run to its 5 s timeout in turn)."""
    sent = []
    for room in ROOMS:
        answer = await post(http, f"{demo}/send", {"room": room, "sender": "alice", "body": "hi"})
        sent.append(sync_tokens.parse(answer["after"]))
    ids = sorted({i for parsed in sent for i in sync_tokens.writer_ids(parsed)})
    future = "m0~" + "~".join(f"{i}.{10**15 + i}" for i in ids) + "_s0_t0"
    started = time.monotonic()
    query = {"user": "alice", "after": future}
    async with http.get(f"{demo}/sync", params=query, timeout=DEMO_TIMEOUT) as response:
        status, answer = await _answer(response)
    assert status == 200, answer
    # Together, and clamped: under two 5 s waits in turn whatever the machine's pace.
    assert time.monotonic() - started < min(scaled(4), 9.0)
