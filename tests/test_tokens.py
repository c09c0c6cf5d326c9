"""Laws of `StreamToken` and its text and JSON forms (pure, no database).

A token stands for the function "writer -> position" (`get`), so the algebra is checked
against that function over every writer either token lists plus one neither lists.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Coroutine, Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.core.tokens import MAX_TOKEN_TEXT, StreamToken, decode_text
from plait.errors import TokenParseError
from token_strategies import SMALL_NAMES, tokens

BIGINT = 2**63 - 1
UNLISTED = "nobody-lists-this-writer"

any_names = st.text(min_size=1, max_size=12)
big_tokens = tokens(names=any_names, max_min=BIGINT // 2, max_ahead=BIGINT // 2)
small_tokens = tokens()


def run_sync(coro: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine on a private loop (Hypothesis drives these tests synchronously)."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(coro)
    finally:
        loop.close()


def universe(*toks: StreamToken) -> list[str]:
    return sorted({w for t in toks for w, _ in t} | {UNLISTED})


def as_function(token: StreamToken, names: Iterable[str]) -> dict[str, int]:
    return {w: token.get(w) for w in names}


def pointwise_le(a: StreamToken, b: StreamToken) -> bool:
    return all(a.get(w) <= b.get(w) for w in universe(a, b))


# -- the representation -----------------------------------------------------------------


@given(small_tokens, small_tokens)
def test_equal_exactly_when_the_functions_are_equal(a: StreamToken, b: StreamToken) -> None:
    names = universe(a, b)
    assert (a == b) == (as_function(a, names) == as_function(b, names))
    if a == b:
        assert hash(a) == hash(b)


@given(small_tokens)
def test_accessors(token: StreamToken) -> None:
    assert all(p > token.min for _, p in token)
    assert token.writers == dict(token)
    assert token.get(UNLISTED) == token.min
    assert token.max == max([token.min, *token.writers.values()])
    assert list(token) == sorted(token.writers.items())
    # `writers` is a copy: changing it does not change the token.
    copy = token.writers
    copy["zzz"] = token.min + 100
    assert "zzz" not in token.writers


@given(st.integers(0, 50), st.dictionaries(SMALL_NAMES, st.integers(0, 60)))
def test_normalised_drops_writers_at_or_below_min(low: int, writers: dict[str, int]) -> None:
    token = StreamToken.normalised(low, writers)
    assert token.min == low
    assert token.writers == {w: p for w, p in writers.items() if p > low}
    for w, p in writers.items():
        assert token.get(w) == max(p, low)


@pytest.mark.parametrize(
    ("low", "writers"),
    [
        (5, {"a": 5}),  # at min
        (5, {"a": 4}),  # below min
        (5, {"a": 7, "b": 5}),
        (0, {"a": 0}),
        (-1, {}),
        (True, {}),
        (1.0, {}),
        ("1", {}),
        (5, {"": 7}),
        (5, {"a": -7}),
        (5, {"a": True}),
        (5, {"a": 7.0}),
        (5, {3: 7}),
        (5, {3: 7, "a": 8}),  # mixed name types must not escape as a TypeError
    ],
)
def test_constructor_rejects_invalid_tokens(low: object, writers: dict[object, object]) -> None:
    with pytest.raises(ValueError, match=r"must be|is not ahead") as info:
        StreamToken(low, writers)  # type: ignore[arg-type]
    assert not isinstance(info.value, TokenParseError)


def test_constructor_message_says_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"writer 'a' at 5 is not ahead of min 5"):
        StreamToken(5, {"a": 5})


# -- the partial order ------------------------------------------------------------------


@given(small_tokens, small_tokens)
def test_is_before_or_eq_is_the_pointwise_order(a: StreamToken, b: StreamToken) -> None:
    assert a.is_before_or_eq(b) == pointwise_le(a, b)


@given(small_tokens)
def test_order_is_reflexive(a: StreamToken) -> None:
    assert a.is_before_or_eq(a)


@given(small_tokens, small_tokens)
def test_order_is_antisymmetric(a: StreamToken, b: StreamToken) -> None:
    if a.is_before_or_eq(b) and b.is_before_or_eq(a):
        assert a == b
    if a != b:
        assert not (a.is_before_or_eq(b) and b.is_before_or_eq(a))


@given(small_tokens, small_tokens, small_tokens)
def test_order_is_transitive(a: StreamToken, x: StreamToken, y: StreamToken) -> None:
    # Random triples are rarely ordered; joins build chains a <= b <= c that always are.
    b = a.copy_and_advance(x)
    c = b.copy_and_advance(y)
    assert a.is_before_or_eq(b)
    assert b.is_before_or_eq(c)
    assert a.is_before_or_eq(c)
    # And on the random triple itself.
    if a.is_before_or_eq(x) and x.is_before_or_eq(y):
        assert a.is_before_or_eq(y)


# -- the join ---------------------------------------------------------------------------


@given(small_tokens, small_tokens)
def test_copy_and_advance_is_the_pointwise_maximum(a: StreamToken, b: StreamToken) -> None:
    joined = a.copy_and_advance(b)
    assert joined.min == max(a.min, b.min)
    for w in universe(a, b):
        assert joined.get(w) == max(a.get(w), b.get(w))
    assert all(p > joined.min for _, p in joined)  # entries not above min were dropped


@given(small_tokens, small_tokens)
def test_join_is_commutative(a: StreamToken, b: StreamToken) -> None:
    assert a.copy_and_advance(b) == b.copy_and_advance(a)


@given(small_tokens, small_tokens, small_tokens)
def test_join_is_associative(a: StreamToken, b: StreamToken, c: StreamToken) -> None:
    left = a.copy_and_advance(b).copy_and_advance(c)
    right = a.copy_and_advance(b.copy_and_advance(c))
    assert left == right


@given(small_tokens)
def test_join_is_idempotent(a: StreamToken) -> None:
    assert a.copy_and_advance(a) == a


@given(small_tokens, small_tokens)
def test_join_is_an_upper_bound(a: StreamToken, b: StreamToken) -> None:
    joined = a.copy_and_advance(b)
    assert a.is_before_or_eq(joined)
    assert b.is_before_or_eq(joined)
    if a.is_before_or_eq(b):
        assert joined == b


@given(small_tokens, small_tokens, small_tokens, small_tokens)
def test_join_is_the_least_upper_bound(
    a: StreamToken, b: StreamToken, c: StreamToken, x: StreamToken
) -> None:
    joined = a.copy_and_advance(b)
    # A random c, and one built to be an upper bound of both.
    for upper in (c, joined.copy_and_advance(x)):
        if a.is_before_or_eq(upper) and b.is_before_or_eq(upper):
            assert joined.is_before_or_eq(upper)


@given(small_tokens, small_tokens)
def test_join_leaves_its_arguments_alone(a: StreamToken, b: StreamToken) -> None:
    before = (a.min, a.writers, b.min, b.writers)
    a.copy_and_advance(b)
    assert before == (a.min, a.writers, b.min, b.writers)


# -- bound --------------------------------------------------------------------------------


@given(small_tokens, st.integers(0, 14))
def test_bound_clamps_every_component(token: StreamToken, cap: int) -> None:
    bounded = token.bound(cap)
    assert bounded.min <= cap
    assert bounded.max <= cap
    assert all(p <= cap for _, p in bounded)
    assert bounded.is_before_or_eq(token)
    for w in universe(token):
        assert bounded.get(w) == min(token.get(w), cap)
    if token.max <= cap:
        assert bounded is token
    # Clamping twice changes nothing more.
    assert bounded.bound(cap) == bounded


@given(small_tokens, small_tokens, st.integers(0, 14))
def test_bound_is_monotone(a: StreamToken, x: StreamToken, cap: int) -> None:
    b = a.copy_and_advance(x)  # a <= b
    assert a.bound(cap).is_before_or_eq(b.bound(cap))


@given(small_tokens, st.integers(-5, -1))
def test_bound_below_zero_clamps_to_zero(token: StreamToken, cap: int) -> None:
    assert token.bound(cap) == StreamToken(0)


def test_bound_logs_when_it_clamps(caplog: pytest.LogCaptureFixture) -> None:
    token = StreamToken(3, {"a": 9, "b": 5})
    with caplog.at_level(logging.WARNING, logger="plait.core.tokens"):
        assert token.bound(9) is token
        assert not caplog.records
        assert token.bound(6) == StreamToken(3, {"a": 6, "b": 5})
    assert any("clamping" in r.getMessage() for r in caplog.records)
    assert token.bound(2) == StreamToken(2)


# -- from_generator -----------------------------------------------------------------------


class FakeGenerator:
    """A `PositionSource`: what `from_generator` reads from a generator."""

    def __init__(
        self, current: int, positions: dict[str, int], for_writer: dict[str, int], backwards: bool
    ) -> None:
        self._current = current
        self._positions = positions
        self._for_writer = for_writer
        self._backwards = backwards

    def get_current_token(self) -> int:
        return self._current

    def get_positions(self) -> dict[str, int]:
        return dict(self._positions)

    def get_current_token_for_writer(self, instance_name: str) -> int:
        return self._for_writer[instance_name]

    @property
    def backwards(self) -> bool:
        return self._backwards


@given(
    st.integers(1, 1000),
    st.dictionaries(SMALL_NAMES, st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=4),
    st.booleans(),
)
def test_from_generator(current: int, writers: dict[str, tuple[int, int]], backwards: bool) -> None:
    sign = -1 if backwards else 1
    # Positions as a generator has them: at or ahead of persisted-up-to. The value from
    # get_current_token_for_writer (idle-advanced) may differ from get_positions().
    positions = {w: sign * (current + last) for w, (last, _) in writers.items()}
    for_writer = {w: sign * (current + last + extra) for w, (last, extra) in writers.items()}
    gen = FakeGenerator(sign * current, positions, for_writer, backwards)

    token = StreamToken.from_generator(gen)
    assert token.min == current  # magnitudes, never negative
    for w in writers:
        assert token.get(w) == abs(for_writer[w])
    assert token.get(UNLISTED) == current
    assert set(token.writers) == {w for w in writers if abs(for_writer[w]) > current}


def test_from_generator_plain_numbers() -> None:
    forwards = FakeGenerator(7, {"a": 7, "b": 9}, {"a": 7, "b": 12}, backwards=False)
    assert StreamToken.from_generator(forwards) == StreamToken(7, {"b": 12})
    backwards = FakeGenerator(-5, {"a": -5, "b": -8}, {"a": -6, "b": -8}, backwards=True)
    assert StreamToken.from_generator(backwards) == StreamToken(5, {"a": 6, "b": 8})


# -- text form ----------------------------------------------------------------------------


@st.composite
def tokens_with_ids(draw: st.DrawFn) -> tuple[StreamToken, dict[str, int]]:
    token = draw(big_tokens)
    names = [w for w, _ in token]
    ids = draw(
        st.lists(st.integers(0, BIGINT), min_size=len(names), max_size=len(names), unique=True)
    )
    return token, dict(zip(names, ids, strict=True))


@given(tokens_with_ids())
def test_text_round_trip(case: tuple[StreamToken, dict[str, int]]) -> None:
    token, ids = case
    text = token.encode_text(ids)
    low, by_id = decode_text(text)
    assert low == token.min
    assert by_id == {ids[w]: p for w, p in token}
    names = {i: w for w, i in ids.items()}
    assert StreamToken(low, {names[i]: p for i, p in by_id.items()}) == token
    if token.writers:
        assert re.fullmatch(r"m\d+(~\d+\.\d+)+", text)
    else:
        assert text == f"s{token.min}"


def test_text_form_plain_numbers() -> None:
    assert StreamToken(5).encode_text({}) == "s5"
    token = StreamToken(5, {"x": 9, "y": 7})
    assert token.encode_text({"x": 1, "y": 2}) == "m5~1.9~2.7"
    assert token.encode_text({"x": 3, "y": 2}) == "m5~2.7~3.9"  # sorted by id
    with pytest.raises(ValueError, match="no instance id given for writer"):
        token.encode_text({"x": 1})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("s0", (0, {})),
        ("s5", (5, {})),
        ("m5", (5, {})),
        ("m5~", (5, {})),
        ("m5~1.7", (5, {1: 7})),
        ("m5~1.7~", (5, {1: 7})),
        ("m0~0.1~2.3", (0, {0: 1, 2: 3})),
        ("m5~2.9~1.7", (5, {1: 7, 2: 9})),  # any entry order
        (f"s{BIGINT}", (BIGINT, {})),
    ],
)
def test_decode_valid(text: str, expected: tuple[int, dict[int, int]]) -> None:
    assert decode_text(text) == expected


MALFORMED = [
    ("", "malformed token"),
    ("s", "malformed token"),
    ("s-1", "malformed token"),
    ("s01", "malformed token"),
    ("x5", "malformed token"),
    ("m5~1", r"entry '1' is not <id>\.<pos>"),
    ("m5~1.2", "instance id 1 at 2 is not ahead of min 5"),
    ("m5~1.5", "instance id 1 at 5 is not ahead of min 5"),
    ("m5~1.7~1.8", "instance id 1 appears twice"),
    ("m5~a.b", r"entry 'a\.b' is not <id>\.<pos>"),
    (" s5", "malformed token"),
    ("s5 ", "malformed token"),
    ("s5\n", "malformed token"),
    ("m5~~1.7", r"entry '' is not <id>\.<pos>"),
    ("m5~1.7~~", r"entry '' is not <id>\.<pos>"),
    ("m5~1.7.8", "is not <id>"),
    ("m5~01.7", "is not <id>"),
    ("m5~1.07", "is not <id>"),
    ("m~1.7", "malformed token"),
    ("m-5~1.7", "malformed token"),
    ("M5~1.7", "malformed token"),
    ("S5", "malformed token"),
    ("s5~1.7", "malformed token"),
    ("m5 ~1.7", "malformed token"),
    ("m5~ 1.7", "is not <id>"),
    ("s\uff15", "malformed token"),  # a full-width digit is not a digit here
    ("s" + "9" * 20, "malformed token"),  # longer than any BIGINT
    ("m5~1." + "9" * 20, "is not <id>"),
    ("x" * 100_000, "characters long"),
    ("m5~" + "1.7~" * 20_000, "characters long"),
]


@pytest.mark.parametrize(("text", "reason"), MALFORMED)
def test_decode_malformed(text: str, reason: str) -> None:
    with pytest.raises(TokenParseError, match=reason) as info:
        decode_text(text)
    # The message quotes the text (shortened), never a 100k-character wall.
    assert len(str(info.value)) < 300


@pytest.mark.parametrize("value", [None, 5, b"s5", ["s5"], 5.0])
def test_decode_rejects_non_text(value: object) -> None:
    with pytest.raises(TokenParseError, match="must be text"):
        decode_text(value)  # type: ignore[arg-type]


def check_decode(text: str) -> None:
    """`decode_text` either returns a valid decoding or raises TokenParseError."""
    try:
        low, by_id = decode_text(text)
    except TokenParseError as err:
        assert err.args, "a TokenParseError must say what is wrong"  # noqa: PT017
        return
    # Anything accepted is a real token: re-encoding it decodes to the same thing.
    assert low >= 0
    assert all(i >= 0 and p > low for i, p in by_id.items())
    names = {i: f"w{i}" for i in by_id}
    token = StreamToken(low, {names[i]: p for i, p in by_id.items()})
    again = token.encode_text({w: i for i, w in names.items()})
    assert decode_text(again) == (low, by_id)


@settings(max_examples=400)
@given(st.text())
def test_decode_any_text_only_raises_token_parse_error(text: str) -> None:
    check_decode(text)


@settings(max_examples=400)
@given(
    st.one_of(
        st.text(alphabet="sm0123456789~.-x ", max_size=24),
        st.from_regex(r"[sm]?-?[0-9]{0,3}(~[0-9]{0,2}\.?[0-9]{0,3}){0,4}~?", fullmatch=True),
    )
)
def test_decode_near_tokens_only_raises_token_parse_error(text: str) -> None:
    check_decode(text)


def test_decode_text_limit() -> None:
    longest = "m0~" + "~".join(f"{i}.1" for i in range(20_000))
    longest = longest[:MAX_TOKEN_TEXT].rsplit("~", 1)[0]
    assert len(longest) <= MAX_TOKEN_TEXT
    low, by_id = decode_text(longest)
    assert low == 0
    assert len(by_id) > 1000


# -- JSON form ----------------------------------------------------------------------------


@given(big_tokens)
def test_json_round_trip(token: StreamToken) -> None:
    value = token.to_json_dict()
    assert value == {"min": token.min, "writers": token.writers}
    assert StreamToken.from_json_dict(json.loads(json.dumps(value))) == token
    assert StreamToken.from_json_dict(value) == token


def test_json_without_writers() -> None:
    assert StreamToken.from_json_dict({"min": 4}) == StreamToken(4)
    assert StreamToken.from_json_dict({"min": 4, "writers": {}}) == StreamToken(4)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ([], "must be an object"),
        ("s5", "must be an object"),
        (None, "must be an object"),
        ({}, '"min" must be a non-negative integer'),
        ({"min": -1}, '"min" must be a non-negative integer'),
        ({"min": True}, '"min" must be a non-negative integer'),
        ({"min": 1.0}, '"min" must be a non-negative integer'),
        ({"min": "1"}, '"min" must be a non-negative integer'),
        ({"min": 5, "writers": []}, '"writers" must be an object'),
        ({"min": 5, "writers": None}, '"writers" must be an object'),
        ({"min": 5, "extra": 1}, r"unknown keys in JSON token: \['extra'\]"),
        ({"min": 5, "writers": {"a": 5}}, "not ahead of min 5"),
        ({"min": 5, "writers": {"": 7}}, "non-empty strings"),
        ({"min": 5, "writers": {"a": True}}, "non-negative int"),
        ({"min": 5, "writers": {"a": 7.0}}, "non-negative int"),
        ({"min": 5, "writers": {"a": "7"}}, "non-negative int"),
        ({"min": 5, "writers": {7: 9}}, "non-empty strings"),
        ({"min": 5, "writers": {7: 9, "a": 8}}, "non-empty strings"),
    ],
)
def test_json_malformed(value: object, reason: str) -> None:
    with pytest.raises(TokenParseError, match=reason):
        StreamToken.from_json_dict(value)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 12) | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(max_size=5) | st.integers(-2, 3), children, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=400)
@given(
    st.one_of(
        json_values,
        st.fixed_dictionaries(
            {"min": json_values | st.integers(0, 9)},
            optional={
                "writers": json_values
                | st.dictionaries(
                    st.sampled_from(["a", "b", "", 1]), st.integers(-1, 12) | json_values
                )
            },
        ),
    )
)
def test_from_json_only_raises_token_parse_error(value: object) -> None:
    try:
        token = StreamToken.from_json_dict(value)
    except TokenParseError as err:
        assert err.args, "a TokenParseError must say what is wrong"  # noqa: PT017
        return
    assert StreamToken.from_json_dict(token.to_json_dict()) == token


# -- async text helpers -------------------------------------------------------------------


class FakeInstanceMap:
    """An in-memory `InstanceNames`: ids are handed out on first use, like instance_map."""

    def __init__(self) -> None:
        self.by_name: dict[str, int] = {}
        self.calls = 0

    async def get_instance_ids(self, names: list[str]) -> dict[str, int]:
        self.calls += 1
        for name in names:
            self.by_name.setdefault(name, len(self.by_name) + 1)
        return {name: self.by_name[name] for name in names}

    async def get_instance_names(self, ids: list[int]) -> dict[int, str]:
        self.calls += 1
        by_id = {i: n for n, i in self.by_name.items()}
        return {i: by_id[i] for i in ids if i in by_id}


@settings(max_examples=200)
@given(st.lists(big_tokens, min_size=1, max_size=4))
def test_to_string_and_parse_round_trip(toks: list[StreamToken]) -> None:
    async def run() -> None:
        names = FakeInstanceMap()
        texts = [await t.to_string(names) for t in toks]
        for token, text in zip(toks, texts, strict=True):
            assert await StreamToken.parse(names, text) == token
            assert decode_text(text)[0] == token.min
        # Every listed writer got an id, and no id was handed out twice.
        listed = {w for t in toks for w, _ in t}
        assert set(names.by_name) == listed
        assert len(set(names.by_name.values())) == len(listed)

    run_sync(run())


async def test_parse_plain_numbers() -> None:
    names = FakeInstanceMap()
    token = StreamToken(5, {"master": 9, "worker1": 7})
    text = await token.to_string(names)
    assert text == "m5~1.9~2.7"
    assert await StreamToken.parse(names, "m5~2.7~1.9") == token
    assert await StreamToken.parse(names, "m5~") == StreamToken(5)
    # Tokens without writers need no lookups at all.
    calls = names.calls
    assert await StreamToken(3).to_string(names) == "s3"
    assert await StreamToken.parse(names, "s3") == StreamToken(3)
    assert names.calls == calls


async def test_parse_unknown_instance_id() -> None:
    names = FakeInstanceMap()
    await StreamToken(5, {"master": 9}).to_string(names)
    with pytest.raises(TokenParseError, match="instance id 42"):
        await StreamToken.parse(names, "m5~1.9~42.8")
    with pytest.raises(TokenParseError, match="not ahead of min"):
        await StreamToken.parse(names, "m5~1.3")
    with pytest.raises(TokenParseError, match="malformed"):
        await StreamToken.parse(names, "garbage")


@settings(max_examples=200)
@given(st.text(alphabet="sm0123456789~.", max_size=16))
def test_parse_any_text_only_raises_token_parse_error(text: str) -> None:
    async def run() -> None:
        names = FakeInstanceMap()
        await names.get_instance_ids(["a", "b", "c"])  # ids 1, 2, 3 are known
        try:
            token = await StreamToken.parse(names, text)
        except TokenParseError:
            return
        assert await StreamToken.parse(names, await token.to_string(names)) == token

    run_sync(run())
