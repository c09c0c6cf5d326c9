"""Signed Redis messages, the pure part: signing, verifying, replays, gaps, stamps, and
which lines a sender may send (plait.core.signed_messages)."""

from __future__ import annotations

from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.config import InstanceConfig
from plait.core import signed_messages as sm
from plait.core.signed_messages import Accepted, Refused, Signer, Verifier, foreign
from plait.errors import ConfigError
from plait.replication.redis_options import check_signing, is_local

KEY = sm.key_of("s3cret")
CHANNEL = "plait.prod"
NOW = 1_700_000_000_000
SKEW = 60_000
# Lone surrogates (category Cs): UTF-8 cannot encode them.
SURROGATES: tuple[Literal["Cs"]] = ("Cs",)

names = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)
lines = st.lists(
    st.text(st.characters(exclude_characters="\n", exclude_categories=SURROGATES), max_size=40),
    min_size=1,
    max_size=5,
)


def body(*text: str) -> bytes:
    return "\n".join(text).encode()


def verifier() -> Verifier:
    return Verifier(KEY, CHANNEL, max_skew_ms=SKEW)


def reason(verdict: Accepted | Refused) -> str:
    return "accepted" if isinstance(verdict, Accepted) else verdict.reason


@given(names, lines)
def test_a_signed_message_verifies_and_keeps_its_lines_and_sender(
    sender: str, text: list[str]
) -> None:
    message = Signer(KEY, CHANNEL, sender, "run1").sign(body(*text), NOW)
    verdict = verifier().check(message, NOW)
    assert verdict == Accepted(sender.encode())
    assert message.split(b"\n")[1:] == [line.encode() for line in text]


@given(lines, st.data())
def test_any_change_to_a_signed_message_is_refused(text: list[str], data: st.DataObject) -> None:
    message = bytearray(Signer(KEY, CHANNEL, "w1", "run1").sign(body(*text), NOW))
    index = data.draw(st.integers(0, len(message) - 1))
    message[index] ^= data.draw(st.integers(1, 255))
    assert not isinstance(verifier().check(bytes(message), NOW), Accepted)


def test_another_secret_or_channel_does_not_verify_and_unsigned_lines_are_told_apart() -> None:
    message = Signer(KEY, CHANNEL, "w1", "run1").sign(b"POSITION s w1 0 5", NOW)
    other_key = Verifier(sm.key_of("other"), CHANNEL, max_skew_ms=SKEW)
    other_channel = Verifier(KEY, "plait.staging", max_skew_ms=SKEW)
    assert reason(other_key.check(message, NOW)) == sm.BAD_SIGNATURE
    assert reason(other_channel.check(message, NOW)) == sm.BAD_SIGNATURE
    assert reason(verifier().check(b"POSITION s w2 0 1000000000", NOW)) == sm.UNSIGNED
    assert reason(verifier().check(b"", NOW)) == sm.UNSIGNED
    assert sm.looks_signed(message)
    assert not sm.looks_signed(b"POSITION s w2 0 1000000000")
    too_big = b"x" * (sm.MAX_MESSAGE_BYTES + 1)
    assert reason(verifier().check(too_big, NOW)) == sm.OVERSIZED


def test_a_verified_message_with_a_header_of_another_format_is_malformed() -> None:
    base = sm._base(KEY, CHANNEL)  # a holder of the secret, speaking another version

    def forged(header: bytes) -> bytes:
        mac = base.copy()
        mac.update(header + b"\nREPLICATE")
        return mac.hexdigest().encode() + b" " + header + b"\nREPLICATE"

    for header in (b"w1 run1 1", b"w1 run1 0 5", b"w1 run1 x 5", b"w1  run1 1 5", b"w1 r 1 5 6"):
        assert reason(verifier().check(forged(header), NOW)) == sm.MALFORMED, header
    assert isinstance(verifier().check(forged(b"w1 run1 1 %d" % NOW), NOW), Accepted)


def test_replays_are_refused_on_the_session_and_after_it() -> None:
    signer = Signer(KEY, CHANNEL, "w1", "run1")
    first, second, third = (signer.sign(b"REPLICATE", NOW) for _ in range(3))
    v = verifier()
    assert reason(v.check(first, NOW)) == "accepted"
    assert reason(v.check(first, NOW)) == sm.REPLAYED
    assert reason(v.check(second, NOW)) == "accepted"
    v.new_session()  # a reconnect: the run continues, the replays stay refused
    assert reason(v.check(first, NOW)) == sm.REPLAYED
    assert reason(v.check(second, NOW)) == sm.REPLAYED
    assert reason(v.check(third, NOW)) == "accepted"


def test_a_gap_in_a_run_restarts_the_session_and_the_next_message_starts_it_over() -> None:
    signer = Signer(KEY, CHANNEL, "w1", "run1")
    messages = [signer.sign(b"REPLICATE", NOW) for _ in range(4)]
    v = verifier()
    assert reason(v.check(messages[0], NOW)) == "accepted"
    gap = v.check(messages[2], NOW)
    assert isinstance(gap, Refused)
    assert (gap.reason, gap.sender, gap.restart) == (sm.GAP, b"w1", True)
    v.new_session()
    assert reason(v.check(messages[3], NOW)) == "accepted"  # first of the run here


def test_only_the_first_message_of_a_run_on_a_session_must_be_fresh() -> None:
    old = Signer(KEY, CHANNEL, "w1", "run1")
    v = verifier()
    assert reason(v.check(old.sign(b"DEPART w1", NOW - SKEW - 1), NOW)) == sm.STALE
    assert reason(v.check(old.sign(b"DEPART w1", NOW + SKEW + 1), NOW)) == sm.STALE
    live = Signer(KEY, CHANNEL, "w1", "run2")
    assert reason(v.check(live.sign(b"REPLICATE", NOW - SKEW), NOW)) == "accepted"
    # Later messages of an accepted run: their order proves them, not the clocks (a
    # receiver that reads slowly must not drop rows).
    assert reason(v.check(live.sign(b"REPLICATE", NOW - 10 * SKEW), NOW)) == "accepted"


@settings(max_examples=200)
@given(st.data())
def test_whatever_is_replayed_each_session_accepts_a_gap_free_run_once(
    data: st.DataObject,
) -> None:
    """Publishers send runs in order; an attacker replays any message already sent, at
    any time; sessions start over. Per session and run, the accepted seqs are
    consecutive, and no message is accepted twice in the process: a replay can only
    stand in for a stretch of what was really sent, as a session that began earlier."""
    signers = {run: Signer(KEY, CHANNEL, "w1", run) for run in ("a", "b")}
    sent: dict[str, list[bytes]] = {"a": [], "b": []}
    delivered = {"a": 0, "b": 0}  # how far Redis delivered each run to the subscriber
    v = verifier()
    accepted_ever: set[bytes] = set()
    session: dict[bytes, list[int]] = {}
    for _ in range(data.draw(st.integers(1, 60))):
        step = data.draw(st.sampled_from(["publish", "deliver", "replay", "reconnect"]))
        run = data.draw(st.sampled_from(["a", "b"]))
        if step == "publish":
            sent[run].append(signers[run].sign(b"REPLICATE", NOW))
            continue
        if step == "reconnect":  # what was published meanwhile is never delivered
            v.new_session()
            session.clear()
            delivered = {r: len(sent[r]) for r in sent}
            continue
        if step == "deliver":
            if delivered[run] == len(sent[run]):
                continue
            message = sent[run][delivered[run]]
            delivered[run] += 1
        else:
            if not sent[run]:
                continue
            message = data.draw(st.sampled_from(sent[run]))
        verdict = v.check(message, NOW)
        if isinstance(verdict, Refused):
            if verdict.restart:
                v.new_session()
                session.clear()
                delivered = {r: len(sent[r]) for r in sent}
            continue
        assert message not in accepted_ever
        accepted_ever.add(message)
        seq = int(message.split(b"\n")[0].split(b" ")[3])
        seqs = session.setdefault(run.encode(), [])
        assert not seqs or seq == seqs[-1] + 1, (seqs, seq)
        seqs.append(seq)


@given(names, names, st.integers(-(10**12), 10**12), st.integers(-(10**12), 10**12))
def test_lines_may_speak_only_for_their_sender_or_announce_a_fence(
    sender: str, other: str, prev: int, new: int
) -> None:
    s = sender.encode()
    assert not foreign(f"RDATA events {sender} {new} []".encode(), s)
    assert not foreign(f"RDATA events {sender} batch []".encode(), s)
    assert not foreign(f"POSITION events {sender} {prev} {new}".encode(), s)
    assert not foreign(f"DEPART {sender}".encode(), s)
    assert not foreign(b"REPLICATE", s)
    assert not foreign(f"USER_SYNC {other} start".encode(), s)  # an application's
    if other != sender:
        assert foreign(f"RDATA events {other} {new} []".encode(), s)
        assert foreign(f"DEPART {other}".encode(), s)
        assert foreign(f"POSITION events {other} {prev} {new}".encode(), s)
        assert not foreign(f"FENCED events {other} {new}".encode(), s)  # checked in the DB


def test_the_finding_s_lines_are_foreign_to_any_other_sender() -> None:
    assert foreign(b"POSITION notes w2 0 1000000000", b"w1")
    assert foreign(b'RDATA notes w1 32 {"x":1}', b"w2")
    assert foreign(b"POSITION notes w2 0 1000000000", b"w")  # a prefix is not the name
    assert foreign(b"RDATA notes w1x 32 {}", b"w1")


@pytest.mark.parametrize(
    ("url", "local"),
    [
        ("redis://127.0.0.1:6379/0", True),
        ("redis://localhost/0", True),
        ("rediss://[::1]:6380/0", True),
        ("redis://127.8.0.1/0", True),
        ("unix:///run/redis.sock", True),
        ("redis://redis:6379/0", False),
        ("redis://10.0.0.5/0", False),
        ("rediss://redis.example.com/0", False),
        ("redis://user:pw@localhost.example.com/0", False),
        ("redis://[::1/0", False),
    ],
)
def test_without_a_secret_only_a_redis_on_this_machine_is_allowed(url: str, local: bool) -> None:
    assert is_local(url) == local
    check_signing(url, "s")
    if local:
        check_signing(url, None)
    else:
        with pytest.raises(ConfigError, match=r"replication\.secret"):
            check_signing(url, None)
    with pytest.raises(ConfigError, match=r"replication\.secret is empty"):
        check_signing(url, "")


def test_the_configuration_refuses_unsigned_lines_through_a_redis_off_this_machine() -> None:
    def load(**replication: object) -> InstanceConfig:
        return InstanceConfig.load(
            {"instance_name": "w1", "replication": {"transport": "redis", **replication}}
        )

    remote = {"url": "redis://redis.internal:6379/0"}
    with pytest.raises(ConfigError, match=r"not on this machine and replication\.secret"):
        load(redis=remote)
    with pytest.raises(ConfigError, match=r"replication\.secret is empty"):
        load(redis=remote, secret="")
    config = load(redis={**remote, "max_clock_skew": 5}, secret="s3cret").replication
    assert config.secret_value() == "s3cret"
    assert config.redis.max_clock_skew == 5
    assert "s3cret" not in repr(config)
    assert load().replication.secret_value() is None  # the default: a local Redis
    load(transport="none", redis=remote)  # not the transport: not checked
