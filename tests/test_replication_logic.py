"""Both halves of replication against a model: a writer's commands reach a reader that
connects late, drops off and comes back; every row arrives exactly once, in order
(pure, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.core.commands import Command, CommandSet, Fenced, Position, Rdata, to_line
from plait.core.inbound import Deliver, Departure, Inbound, Plan
from plait.core.outbound import Outbound

COMMANDS = CommandSet()

STREAM = "events"
WRITER = "w"


@dataclass
class Script:
    """What one writer did: its rows (token, row) and the commands it sent in order,
    with the writer's position when each command was sent."""

    rows: list[tuple[int, str]]
    sent: list[tuple[Command, int]]


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    rows: list[tuple[int, str]] = []
    sent: list[tuple[Command, int]] = []
    position = announced = 1
    for _ in range(draw(st.integers(0, 12))):
        token = position + draw(st.integers(1, 3))
        count = draw(st.integers(1, 3))
        for i in range(count):
            row = f"{token}.{i}"
            rows.append((token, row))
            last = i == count - 1
            sent.append((Rdata(STREAM, WRITER, token if last else None, row), position))
        position = token
        if draw(st.booleans()):  # idle: others took IDs meanwhile
            position += draw(st.integers(0, 3))
        if draw(st.booleans()):
            sent.append((Position(STREAM, WRITER, announced, position), position))
            announced = position
    sent.append((Position(STREAM, WRITER, announced, position), position))
    return Script(rows, sent)


def read(rows: list[tuple[int, str]], low: int, high: int) -> list[tuple[int, str]]:
    """What a catch-up read of (low, high] returns (the database side)."""
    return [(t, r) for t, r in rows if low < t <= high]


@given(scripts(), st.data())
def test_every_row_arrives_exactly_once_in_order(script: Script, data: st.DataObject) -> None:
    # The reader starts somewhere in the writer's past (its position loaded at start-up),
    # and is connected to the writer's commands only during some stretches.
    tokens = [1] + [t for t, _ in script.rows]
    start = data.draw(st.sampled_from(tokens), label="start")
    online = data.draw(
        st.lists(st.booleans(), min_size=len(script.sent), max_size=len(script.sent)),
        label="online",
    )
    online[-1] = True  # it is connected at the end, to see the final POSITION
    inbound = Inbound(own_name="reader")
    current = start
    got: list[tuple[int, str]] = []

    def apply(result: Deliver | Plan | None) -> None:
        nonlocal current
        if isinstance(result, Deliver):
            got.extend((result.token, row) for row in result.rows)
            current = result.token
        elif isinstance(result, Plan):
            if result.catch_up_from is not None and result.advance_to is not None:
                got.extend(read(script.rows, result.catch_up_from, result.advance_to))
            if result.advance_to is not None:
                current = result.advance_to
            inbound.caught_up(result.stream, result.instance)

    was_online = awaiting_answer = after_batch_row = False
    for (command, writer_position), up in zip(script.sent, online, strict=True):
        if not up:
            if was_online:
                inbound.lost()
            was_online = awaiting_answer = False
        else:
            if not was_online:
                # (Re)connected: it sends REPLICATE; the writer answers with its position
                # between two of its sends, never inside a batch.
                was_online = awaiting_answer = True
            if awaiting_answer and not after_batch_row:
                answer = Position(STREAM, WRITER, writer_position, writer_position)
                apply(inbound.position(answer, current))
                awaiting_answer = False
            if isinstance(command, Rdata):
                apply(inbound.rdata(command, current))
            else:
                assert isinstance(command, Position)
                apply(inbound.position(command, current))
        after_batch_row = isinstance(command, Rdata) and command.token is None

    assert got == [(t, r) for t, r in script.rows if t > start]
    assert current == script.sent[-1][1]


def test_rdata_before_the_writers_position_on_this_connection_is_ignored() -> None:
    inbound = Inbound(own_name="reader")
    assert inbound.rdata(Rdata(STREAM, "a", 5, "x"), current=1) is None
    plan = inbound.position(Position(STREAM, "a", 3, 7), current=1)
    assert plan == Plan(STREAM, "a", catch_up_from=1, advance_to=7)
    inbound.caught_up(STREAM, "a")
    # Caught up with a, not with b: b's rows wait for b's POSITION.
    assert inbound.rdata(Rdata(STREAM, "b", 8, "y"), current=1) is None
    assert inbound.rdata(Rdata(STREAM, "a", 8, "z"), current=7) == Deliver(STREAM, "a", 8, ["z"])
    assert inbound.all_connected({(STREAM, "a")})
    assert not inbound.all_connected({(STREAM, "a"), (STREAM, "b")})


def test_positions_within_reach_advance_without_reading() -> None:
    inbound = Inbound(own_name="reader")
    assert inbound.position(Position(STREAM, "a", 3, 9), current=5) == Plan(STREAM, "a", None, 9)
    assert inbound.position(Position(STREAM, "a", 3, 9), current=3) == Plan(STREAM, "a", None, 9)
    # Behind us: nothing to read, nothing to move (never backwards).
    assert inbound.position(Position(STREAM, "a", 3, 9), current=12) == Plan(
        STREAM, "a", None, None
    )


def test_batches_are_held_per_writer_and_dropped_when_stale() -> None:
    inbound = Inbound(own_name="reader")
    for writer in ("a", "b"):
        inbound.position(Position(STREAM, writer, 1, 1), current=1)
        inbound.caught_up(STREAM, writer)
    assert inbound.rdata(Rdata(STREAM, "a", None, 1), current=1) is None
    assert inbound.rdata(Rdata(STREAM, "b", None, 2), current=1) is None
    assert inbound.rdata(Rdata(STREAM, "a", 4, 3), current=1) == Deliver(STREAM, "a", 4, [1, 3])
    # b's batch ends at a token already seen (a catch-up read it): all of it is dropped.
    assert inbound.rdata(Rdata(STREAM, "b", 5, 4), current=5) is None
    assert inbound.rdata(Rdata(STREAM, "b", 6, 5), current=5) == Deliver(STREAM, "b", 6, [5])


def test_own_echoes_and_a_lost_connection() -> None:
    inbound = Inbound(own_name="me")
    assert inbound.position(Position(STREAM, "me", 1, 5), current=1) is None
    inbound.caught_up(STREAM, "me")
    assert inbound.rdata(Rdata(STREAM, "me", 6, "echo"), current=5) is None
    inbound.position(Position(STREAM, "a", 1, 1), current=1)
    inbound.caught_up(STREAM, "a")
    inbound.rdata(Rdata(STREAM, "a", None, "held"), current=1)
    inbound.lost()
    assert not inbound.is_connected(STREAM, "a")
    inbound.caught_up(STREAM, "a")
    delivered = inbound.rdata(Rdata(STREAM, "a", 3, "new"), current=1)
    assert delivered == Deliver(STREAM, "a", 3, ["new"])  # the old batch did not survive


def test_a_departed_writer_counts_again_only_after_its_next_position() -> None:
    inbound = Inbound(own_name="me")
    for writer in ("a", "b"):
        inbound.caught_up(STREAM, writer)
        inbound.caught_up("other", writer)
    inbound.rdata(Rdata(STREAM, "a", None, "held"), current=1)
    inbound.departed(Departure(STREAM, "a"))
    assert not inbound.is_connected(STREAM, "a")
    assert inbound.is_connected("other", "a")  # until its own queue gets there
    inbound.departed(Departure("other", "a"))
    assert not inbound.is_connected("other", "a")
    assert inbound.is_connected(STREAM, "b")
    assert inbound.rdata(Rdata(STREAM, "a", 3, "x"), current=1) is None
    inbound.caught_up(STREAM, "a")
    assert inbound.rdata(Rdata(STREAM, "a", 4, "y"), current=1) == Deliver(STREAM, "a", 4, ["y"])


def test_rows_of_a_batch_cut_off_by_a_death_are_not_handed_over_twice() -> None:
    """The writer died inside a batch (y.0 arrived, its numbered row never did). Its
    next life answers with a POSITION, the catch-up reads y.0 from the database, and
    its next batch must not carry y.0 again."""
    inbound = Inbound(own_name="me")
    inbound.caught_up(STREAM, "a")
    assert inbound.rdata(Rdata(STREAM, "a", None, "y.0"), current=4) is None
    plan = inbound.position(Position(STREAM, "a", 9, 9), current=4)
    assert plan == Plan(STREAM, "a", catch_up_from=4, advance_to=9)
    inbound.caught_up(STREAM, "a")
    assert inbound.rdata(Rdata(STREAM, "a", 12, "z"), current=9) == Deliver(STREAM, "a", 12, ["z"])


def test_a_fence_does_not_make_a_writers_rows_count_on_a_connection() -> None:
    """A new connection drops w's RDATA 12 (w's own POSITION not yet there); a FENCED
    of w at 8 arrives from another sender. Were w's rows to count from then on, its
    RDATA 13 would be handed over, and its POSITION 13 13 would read nothing: 12
    skipped. They count only after w's own POSITION, which catches 12 up."""
    inbound = Inbound(own_name="me")
    assert inbound.rdata(Rdata(STREAM, "w", 12, "twelve"), current=5) is None
    plan = inbound.fenced(Fenced(STREAM, "w", 8), current=5)
    assert plan == Plan(STREAM, "w", 5, 8, counts_rows=False)
    assert not inbound.is_connected(STREAM, "w")
    assert inbound.rdata(Rdata(STREAM, "w", 13, "thirteen"), current=8) is None
    plan = inbound.position(Position(STREAM, "w", 13, 13), current=8)
    assert plan == Plan(STREAM, "w", catch_up_from=8, advance_to=13)  # reads 12 and 13


def test_a_fence_between_the_lines_of_a_batch_keeps_its_rows() -> None:
    """A FENCED of another sender may fall between a live writer's batch rows (a
    renewed writer): the batch still ends with its numbered row, whole."""
    inbound = Inbound(own_name="me")
    inbound.caught_up(STREAM, "a")
    assert inbound.rdata(Rdata(STREAM, "a", None, "y.0"), current=4) is None
    assert inbound.fenced(Fenced(STREAM, "a", 5), current=4) == Plan(STREAM, "a", 4, 5, False)
    assert inbound.fenced(Fenced(STREAM, "a", 5), current=5) is None  # no proof needed
    assert inbound.rdata(Rdata(STREAM, "a", 6, "y.1"), current=5) == Deliver(
        STREAM, "a", 6, ["y.0", "y.1"]
    )


# -- the writer's side, and both sides together ----------------------------------------


def test_a_page_becomes_rdata_with_batches_then_a_position() -> None:
    out = Outbound(STREAM, "w", sent_upto=3)
    commands = out.page([(4, "a"), (4, "b"), (6, "c")], upto=9)
    assert [to_line(c) for c in commands] == [
        'RDATA events w batch "a"',
        'RDATA events w 4 "b"',
        'RDATA events w 6 "c"',
        "POSITION events w 6 9",
    ]
    assert out.page([], upto=12) == [Position(STREAM, "w", 9, 12)]  # idle: just POSITION
    assert out.page([], upto=12) == []
    assert out.replicate() == Position(STREAM, "w", 12, 12)
    with pytest.raises(ValueError, match="within"):
        out.page([(12, "old")], upto=15)


@given(st.data())
def test_writer_pages_reach_a_late_reader_exactly_once(data: st.DataObject) -> None:
    """The writer sends its rows page by page; a reader that starts at some point of
    the writer's past and connects at some page boundary ends with every row after its
    start, once and in order."""
    rows: list[tuple[int, str]] = []
    bounds: list[int] = []  # page ends: whole tokens only, as get_updates_since cuts
    token = 1
    for _ in range(data.draw(st.integers(0, 15), label="groups")):
        token += data.draw(st.integers(1, 3))
        rows += [(token, f"{token}.{i}") for i in range(data.draw(st.integers(1, 3)))]
        if data.draw(st.booleans()):
            token += data.draw(st.integers(0, 2))  # idle advance
            bounds.append(token)
    bounds.append(token + 1)
    out = Outbound(STREAM, "w", sent_upto=1)
    start = data.draw(st.sampled_from([1, *[t for t, _ in rows]]), label="start")
    join = data.draw(st.integers(0, len(bounds) - 1), label="join")
    reader = Inbound(own_name="reader")
    current = start
    got: list[tuple[int, str]] = []
    for i, upto in enumerate(bounds):
        if i == join:  # REPLICATE, answered between two pages
            plan = reader.position(out.replicate(), current)
            assert plan is not None
            if plan.catch_up_from is not None and plan.advance_to is not None:
                got += read(rows, plan.catch_up_from, plan.advance_to)
            current = plan.advance_to if plan.advance_to is not None else current
            reader.caught_up(STREAM, "w")
        commands = out.page(read(rows, out.sent_upto, upto), upto)
        if i < join:
            continue  # sent before the reader subscribed: it never sees them
        for command in commands:
            parsed = COMMANDS.parse(to_line(command))  # through the wire text
            if isinstance(parsed, Rdata):
                delivered = reader.rdata(parsed, current)
                if delivered is not None:
                    got += [(delivered.token, r) for r in delivered.rows]
                    current = delivered.token
            else:
                assert isinstance(parsed, Position)
                plan = reader.position(parsed, current)
                assert plan is not None
                if plan.catch_up_from is not None and plan.advance_to is not None:
                    got += read(rows, plan.catch_up_from, plan.advance_to)
                if plan.advance_to is not None:
                    current = plan.advance_to
                reader.caught_up(STREAM, "w")
    assert got == [(t, r) for t, r in rows if t > start]
    assert current == bounds[-1]
