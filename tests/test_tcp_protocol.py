"""The TCP protocol's state machines (plait.core.tcp_protocol), byte by byte and line by
line, without sockets: framing under any cut of the bytes, both handshakes talking to
each other under every combination of secrets, the hub's rules for a client's lines,
and the keepalive's decisions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.core.commands import CommandSet, Error, Name, Server, to_line
from plait.core.tcp_handshake import Accepted, ClientHandshake, HubHandshake, Refused, TellHub
from plait.core.tcp_protocol import (
    BAD_LINES_BURST,
    BAD_LINES_PER_SECOND,
    LINE_TOO_LONG,
    REPLICATE_FREE,
    Admit,
    ClientLines,
    Keepalive,
    LineFramer,
    Route,
    route,
)
from plait.errors import CommandParseError

LIMIT = 32
_line = st.binary(max_size=LIMIT).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b""))


def _cuts(data: bytes, sizes: list[int]) -> list[bytes]:
    chunks, at = [], 0
    for size in sizes:
        chunks.append(data[at : at + size])
        at += size
    chunks.append(data[at:])
    return chunks


def _drain(framer: LineFramer) -> list[bytes]:
    lines = []
    while (line := framer.pop()) is not None:
        lines.append(line)
    return lines


# -- framing ------------------------------------------------------------------------------


@given(
    lines=st.lists(_line, max_size=20),
    crlf=st.lists(st.booleans(), min_size=20, max_size=20),
    sizes=st.lists(st.integers(0, 40), max_size=30),
)
def test_any_cut_of_the_bytes_gives_the_same_lines(
    lines: list[bytes], crlf: list[bool], sizes: list[int]
) -> None:
    data = b"".join(
        line + (b"\r\n" if cr else b"\n") for line, cr in zip(lines, crlf, strict=False)
    )
    framer = LineFramer(LIMIT)
    got: list[bytes] = []
    for chunk in _cuts(data, sizes):
        framer.feed(chunk)
        got += _drain(framer)
    assert got == lines
    assert not framer.too_long
    assert not framer.partial
    assert framer.buffered == 0


@given(
    before=st.lists(_line, max_size=5),
    extra=st.integers(1, 10),
    sizes=st.lists(st.integers(0, 40), max_size=30),
)
def test_a_line_over_the_limit_stops_the_framer_after_the_lines_before_it(
    before: list[bytes], extra: int, sizes: list[int]
) -> None:
    long = b"x" * (LIMIT + extra)
    data = b"".join(line + b"\n" for line in before) + long + b"\nAFTER\n"
    framer = LineFramer(LIMIT)
    got: list[bytes] = []
    for chunk in _cuts(data, sizes):
        framer.feed(chunk)
        got += _drain(framer)
    assert got == before  # nothing of the long line nor after it
    assert framer.too_long


def test_a_line_at_the_limit_passes_with_either_ending() -> None:
    framer = LineFramer(LIMIT)
    framer.feed(b"y" * LIMIT + b"\r")  # the "\r" may be the start of "\r\n"
    assert not framer.too_long
    assert framer.partial
    framer.feed(b"\n" + b"z" * LIMIT + b"\n")
    assert _drain(framer) == [b"y" * LIMIT, b"z" * LIMIT]
    framer.feed(b"w" * (LIMIT + 2))  # no ending can make this fit
    assert framer.too_long
    assert framer.buffered == 0


def test_routes_of_received_lines() -> None:
    assert route("RDATA s w 1 {}") is Route.SESSION
    assert route("MYAPP x") is Route.SESSION  # an application's command
    assert route("ERROR you sent a bad line") is Route.PEER_ERROR
    assert route("PING 123") is Route.PING
    for again in ("NAME w1", "SERVER hub", "CHALLENGE hub 00", "PROOF 00 00"):
        assert route(again) is Route.BAD


# -- the handshake ------------------------------------------------------------------------

_SECRETS = [None, b"s3cret", b"other"]


def _talk(
    client: ClientHandshake, hub: HubHandshake
) -> tuple[Accepted | Refused | TellHub | None, Accepted | Refused | TellHub | None, list[str]]:
    """Run both machines against each other, as the wire would; returns how each ended
    and every line that went over."""
    wire = [client.start()]
    to_hub = [wire[0]]
    client_done = hub_done = None
    while to_hub and hub_done is None:
        step = hub.receive(to_hub.pop(0).encode())
        wire += step.send
        hub_done = step.done
        for line in step.send:
            if client_done is not None:
                break
            answer = client.receive(line.encode())
            wire += answer.send
            to_hub += answer.send
            client_done = answer.done
    if isinstance(hub_done, Refused) and client_done is None:  # the hub says ERROR
        client_done = client.receive(to_line(Error(hub_done.text)).encode()).done
    if isinstance(client_done, TellHub) and hub_done is None:  # the client says ERROR
        hub_done = hub.receive(to_line(Error(client_done.to_hub)).encode()).done
    return client_done, hub_done, wire


@pytest.mark.parametrize("client_secret", _SECRETS)
@pytest.mark.parametrize("hub_secret", _SECRETS)
def test_both_ends_agree_exactly_when_their_secrets_do(
    client_secret: bytes | None, hub_secret: bytes | None
) -> None:
    client = ClientHandshake("w2", client_secret, "aa" * 16)
    hub = HubHandshake("w1", hub_secret, "bb" * 16)
    client_done, hub_done, wire = _talk(client, hub)
    if client_secret == hub_secret:
        assert client_done == Accepted("w1")
        assert hub_done == Accepted("w2")
        assert wire[0] == "NAME w2"
        assert wire[-1].startswith("SERVER w1")
        assert len(wire) == (2 if hub_secret is None else 4)
        assert (hub_secret is None) == ("CHALLENGE w1 " + "bb" * 16 not in wire)
    elif hub_secret is None:
        # The hub asks nothing and is done at once; the client refuses to go on and
        # says why in ERROR, which the hub's side of the connection then logs.
        assert hub_done == Accepted("w2")
        assert isinstance(client_done, TellHub)
        assert "has a replication.secret" in client_done.to_hub
    else:
        assert not isinstance(client_done, Accepted)
        assert isinstance(hub_done, Refused)
        assert hub_done.reason == "auth"
        assert "replication.secret" in hub_done.text


def test_the_secret_is_never_sent_and_proofs_bind_both_nonces() -> None:
    secret = b"s3cret"
    _, _, wire = _talk(
        ClientHandshake("w2", secret, "aa" * 16), HubHandshake("w1", secret, "bb" * 16)
    )
    _, _, again = _talk(
        ClientHandshake("w2", secret, "cc" * 16), HubHandshake("w1", secret, "bb" * 16)
    )
    assert all("s3cret" not in line for line in wire)
    proofs = [line for line in wire if line.startswith(("PROOF", "SERVER"))]
    assert all(line not in again for line in proofs)  # another client nonce, other proofs


@given(first=st.binary(max_size=60))
def test_the_hub_takes_nothing_but_name_first(first: bytes) -> None:
    hub = HubHandshake("w1", None, "bb" * 16)
    step = hub.receive(first)
    try:
        parsed = CommandSet().parse(first)
    except CommandParseError:
        parsed = None
    if isinstance(parsed, Name) and parsed.name != "w1":
        assert step.done == Accepted(parsed.name)
        assert step.send == [to_line(Server("w1"))]
    else:
        assert isinstance(step.done, Refused)
        assert step.send == []
    assert hub.over


def test_the_hubs_own_name_and_replayed_proofs_are_refused() -> None:
    own = HubHandshake("w1", None, "bb" * 16).receive(b"NAME w1").done
    assert own == Refused("NAME w1 is the hub's own name: name every instance differently", "name")
    # A proof recorded from one handshake does not pass another (the hub's nonce differs).
    secret = b"s3cret"
    _, _, wire = _talk(
        ClientHandshake("w2", secret, "aa" * 16), HubHandshake("w1", secret, "bb" * 16)
    )
    proof = next(line for line in wire if line.startswith("PROOF"))
    replay = HubHandshake("w1", secret, "dd" * 16)
    replay.receive(b"NAME w2")
    refused = replay.receive(proof.encode()).done
    assert isinstance(refused, Refused)
    assert refused.reason == "auth"


def test_a_timeout_or_a_long_line_says_what_was_expected() -> None:
    hub = HubHandshake("w1", b"k", "bb" * 16)
    assert hub.timed_out(5) == Refused("expected NAME <name> within 5s")
    hub = HubHandshake("w1", b"k", "bb" * 16)
    hub.receive(b"NAME w2")
    # Once challenged, whatever fails counts as a failed authentication.
    assert hub.timed_out(5) == Refused("expected PROOF <nonce> <proof> within 5s", "auth")
    assert HubHandshake("w1", None, "bb").too_long() == Refused(LINE_TOO_LONG)


def test_a_client_refuses_a_server_proof_nobody_asked_for_and_an_error() -> None:
    client = ClientHandshake("w2", None, "aa")
    client.start()
    assert client.receive(b"SERVER w1 " + b"ab" * 32).done == Refused(
        "the hub sent SERVER with a proof nobody asked for"
    )
    client = ClientHandshake("w2", None, "aa")
    assert client.receive(b"ERROR go away").done == Refused(
        "the hub refused the connection: go away"
    )


# -- the hub's rules for a client's lines ----------------------------------------------------


def test_a_client_speaks_only_in_its_own_name() -> None:
    rules = ClientLines("hub", "w2", now=0.0)
    assert rules.admit("RDATA s w2 5 {}") is Admit.TAKE
    assert rules.admit("POSITION s w2 5") is Admit.TAKE
    assert rules.admit("DEPART w2") is Admit.TAKE
    assert rules.admit(b"\xff\xfe") is Admit.TAKE  # its session answers ERROR
    for line, refusal in [
        ("RDATA s w3 5 {}", "RDATA of w3 refused"),
        ("POSITION s w3 5", "POSITION of w3 refused"),
        ("DEPART w3", "DEPART of w3 refused"),
        ("RDATA s hub 5 {}", "RDATA of hub refused"),
    ]:
        assert rules.admit(line) is Admit.REFUSE
        assert rules.refusal.startswith(refusal)


def test_replicates_past_the_first_few_are_dropped() -> None:
    rules = ClientLines("hub", "w2", now=0.0)
    admitted = [rules.admit("REPLICATE") for _ in range(REPLICATE_FREE + 3)]
    assert admitted == [Admit.TAKE] * REPLICATE_FREE + [Admit.DROP] * 3


def test_what_is_relayed() -> None:
    relayed = ClientLines.relayed
    assert relayed("RDATA s w2 5 {}", answered_error=False)
    assert not relayed("RDATA s w2 oops", answered_error=True)  # built-in, refused
    assert relayed("MYAPP anything", answered_error=True)  # not the hub's to judge
    assert not relayed("lower case", answered_error=False)
    assert not relayed("", answered_error=False)
    assert not relayed(b"\xff", answered_error=False)


@given(gaps=st.lists(st.floats(0, 0.5), min_size=1, max_size=400))
def test_the_bad_line_budget_is_a_burst_then_a_rate(gaps: list[float]) -> None:
    rules = ClientLines("hub", "w2", now=0.0)
    now, allowed = 0.0, 0
    for gap in gaps:
        now += gap
        if rules.bad(now):
            break
        allowed += 1
    else:
        return  # never past it
    assert allowed <= BAD_LINES_BURST + now * BAD_LINES_PER_SECOND
    assert allowed >= BAD_LINES_BURST  # at least the burst, whatever the pace


# -- liveness -----------------------------------------------------------------------------


def test_keepalive_pings_on_time_and_declares_a_silent_peer_dead() -> None:
    alive = Keepalive(ping_interval=1.0, dead_after=3.0, now=0.0)
    assert alive.due(0.5) == (False, None)
    assert alive.wake_at == 1.0
    assert alive.due(1.0) == (True, None)
    assert alive.wake_at == 2.0
    alive.received(1.5)
    assert alive.due(2.0) == (True, None)
    assert alive.wake_at == 3.0
    assert alive.due(4.0) == (True, None)
    ping, silent = alive.due(4.5)
    assert not ping
    assert silent == pytest.approx(3.0)
