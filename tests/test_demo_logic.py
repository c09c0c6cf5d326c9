"""The reference application's pure pieces: room sharding and the sync token."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.core.tokens import StreamToken
from plait.demo import api_requests, presence, sharding
from plait.demo.tokens import SyncToken, parse, resolve, writer_ids
from plait.errors import TokenParseError

NAMES = {1: "ev1", 2: "ev2", 3: "worker"}
IDS = {name: i for i, name in NAMES.items()}
rooms = st.text(min_size=1, max_size=30)
writer_lists = st.lists(st.sampled_from(["ev1", "ev2", "ev3", "ev4"]), min_size=1, unique=True)


@given(rooms, writer_lists)
def test_a_room_has_one_owner_whatever_the_order_of_the_writers(
    room: str, writers: list[str]
) -> None:
    chosen = sharding.owner(room, writers)
    assert chosen in writers
    assert sharding.owner(room, list(reversed(writers))) == chosen


@given(rooms, writer_lists, st.sampled_from(["ev5", "ev6"]))
def test_adding_a_writer_moves_only_the_rooms_it_takes(
    room: str, writers: list[str], extra: str
) -> None:
    after = sharding.owner(room, [*writers, extra])
    assert after in (sharding.owner(room, writers), extra)


def test_rooms_spread_over_the_writers() -> None:
    counts = Counter(sharding.owner(f"!room{i}:demo", ["ev1", "ev2"]) for i in range(2000))
    assert 850 <= counts["ev1"] <= 1150  # binomial: 5 standard deviations is ±112
    # Stable across processes and runs: the same owners as when this test was written.
    rooms = ["!a:demo", "!b:demo", "!room0:demo", "!room1:demo", "!room2:demo"]
    assert [sharding.owner(r, ["ev1", "ev2"]) for r in rooms] == [
        "ev1",
        "ev2",
        "ev2",
        "ev2",
        "ev1",
    ]
    with pytest.raises(ValueError, match="no event writers"):
        sharding.owner("!a:demo", [])


@st.composite
def stream_tokens(draw: st.DrawFn) -> StreamToken:
    low = draw(st.integers(0, 10**12))
    ahead = draw(st.dictionaries(st.sampled_from(list(NAMES.values())), st.integers(1, 10**6)))
    return StreamToken(low, {w: low + d for w, d in ahead.items()})


sync_tokens = st.builds(SyncToken, stream_tokens(), stream_tokens(), st.integers(0, 10**9))


@given(sync_tokens)
def test_sync_tokens_round_trip_through_their_text(token: SyncToken) -> None:
    parsed = parse(token.encode(IDS))
    assert writer_ids(parsed) <= set(NAMES)
    assert resolve(parsed, NAMES) == token


@given(sync_tokens, sync_tokens)
def test_advancing_never_goes_back(a: SyncToken, b: SyncToken) -> None:
    both = a.advanced(b)
    assert a.events.is_before_or_eq(both.events)
    assert b.account_data.is_before_or_eq(both.account_data)
    assert both.typing == max(a.typing, b.typing)


def test_a_token_from_the_future_is_clamped() -> None:
    token = SyncToken(StreamToken(50, {"ev1": 90}), StreamToken(7), 12)
    clamped = token.clamp(events_max=60, account_data_max=9, typing=3)
    assert clamped == SyncToken(StreamToken(50, {"ev1": 60}), StreamToken(7), 3)
    assert token.clamp(100, 100, 100) == token


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("s5_s6", "must have 3 parts"),
        ("s5_s6_t7_x", "must have 3 parts"),
        ("s5_s6_7", "typing part must be t<position>"),
        ("s5_s6_t", "typing part must be t<position>"),
        ("x5_s6_t7", "events part: malformed token"),
        ("s5_m6~1.2_t7", "account data part: malformed token"),
        ("m5~1.9~1.8_s6_t7", "appears twice"),
    ],
)
def test_malformed_sync_tokens_are_refused_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(TokenParseError, match=reason):
        parse(text)


def test_a_token_naming_an_unknown_writer_id_is_refused() -> None:
    with pytest.raises(TokenParseError, match="instance id 9"):
        resolve(parse("m5~9.7_s6_t1"), NAMES)


@given(st.text(max_size=60))
def test_any_text_parses_or_is_refused_clearly(text: str) -> None:
    message = ""
    try:
        parse(text)
    except TokenParseError as err:
        message = str(err)
    assert "\n" not in message  # one line, whatever came in


def test_presence_state_follows_the_commands() -> None:
    syncing = presence.Syncing()
    syncing.apply(presence.UserSync("sync1", "alice", "start", 1))
    syncing.apply(presence.UserSync("sync2", "alice", "start", 2))
    syncing.apply(presence.UserSync("sync2", "bob", "start", 3))
    syncing.apply(presence.UserSync("sync1", "alice", "end", 4))
    assert syncing.online() == {"alice", "bob"}  # still on sync2
    syncing.apply(presence.ClearUserSync("sync2"))
    assert syncing.online() == set()
    syncing.apply(presence.UserSync("sync3", "carol", "end", 5))  # end without start
    assert syncing.online() == set()


def test_a_worker_speaks_only_on_a_users_first_and_last_sync() -> None:
    local = presence.Local()
    assert local.begin("a") is True
    assert local.begin("a") is False
    assert local.end("a") is False
    assert local.end("a") is True
    assert local.begin("a") is True


@pytest.mark.parametrize(
    ("line", "command"),
    [
        ("sync1 @a:x start 17", presence.UserSync("sync1", "@a:x", "start", 17)),
        ("sync1 @a:x end 0", presence.UserSync("sync1", "@a:x", "end", 0)),
    ],
)
def test_user_sync_round_trips(line: str, command: presence.UserSync) -> None:
    assert presence.UserSync.from_args(line) == command
    assert command.to_args() == line
    assert presence.ClearUserSync.from_args("sync1").to_args() == "sync1"


def test_an_optional_field_given_as_null_reads_as_absent() -> None:
    # /typing with "typing": null starts typing, as without the field (it stopped it).
    typing = api_requests.body("set_typing", b'{"room": "r", "user": "u", "typing": null}')
    assert typing == {"room": "r", "user": "u"}
    tag = api_requests.body("set_tag", b'{"user": "u", "room": "r", "tag": "t", "content": null}')
    assert "content" not in tag
