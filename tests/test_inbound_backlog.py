"""Bounded inbound queues (R-RP-9), pure: a `Backlog` never holds more than its bound,
and a reader whose backlog overflows at random moments still gets every row of every
writer exactly once, in order; a writer's departure (R-RP-8) is handled after every row
it sent before it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.config import InstanceConfig
from plait.core.commands import Fenced, Position, Rdata
from plait.core.inbound import (
    DEFAULT_INBOUND_QUEUE,
    Backlog,
    Departure,
    Inbound,
    Plan,
    Queued,
    Resync,
)
from plait.errors import ConfigError

STREAM = "events"
WRITERS = ("w1", "w2", "w3")


@dataclass
class Script:
    """What one writer did: its rows (token, row), and the commands it sent in order,
    each with the position the writer had announced rows up to just before it."""

    writer: str
    rows: list[tuple[int, str]]
    sent: list[tuple[Rdata | Position, int]]


@st.composite
def scripts(draw: st.DrawFn, writer: str, first: int) -> Script:
    """Tokens of different writers never collide: each writer counts from `first`,
    in steps of len(WRITERS)."""
    rows: list[tuple[int, str]] = []
    sent: list[tuple[Rdata | Position, int]] = []
    step = len(WRITERS)
    position = announced = first
    for _ in range(draw(st.integers(0, 15))):
        token = position + step * draw(st.integers(1, 3))
        count = draw(st.integers(1, 3))
        for i in range(count):
            row = f"{writer}:{token}.{i}"
            rows.append((token, row))
            last = i == count - 1
            sent.append((Rdata(STREAM, writer, token if last else None, row), position))
        position = token
        if draw(st.booleans()):  # idle: others took IDs meanwhile
            position += step * draw(st.integers(0, 3))
        if draw(st.booleans()):
            sent.append((Position(STREAM, writer, announced, position), position))
            announced = position
    sent.append((Position(STREAM, writer, announced, position), position))
    return Script(writer, rows, sent)


@st.composite
def lives(draw: st.DrawFn, writer: str, first: int) -> list[Script]:
    """A writer that restarts: each life goes on from the position the last one left
    at (a durable stream)."""
    result = []
    for _ in range(draw(st.integers(1, 3))):
        result.append(draw(scripts(writer, first)))
        first = result[-1].sent[-1][1]
    return result


class Reader:
    """The shell's part, without I/O: handles what the backlog hands out, reads
    catch-ups from the writers' rows (the database), delivers; notes, at each
    departure, what it had of that writer."""

    def __init__(self, scripts: list[Script], starts: dict[str, int]) -> None:
        self.inbound = Inbound(own_name="reader")
        self.rows = {s.writer: s.rows for s in scripts}
        self.current = dict(starts)
        self.got: dict[str, list[tuple[int, str]]] = {s.writer: [] for s in scripts}
        self.departures: dict[str, list[tuple[list[tuple[int, str]], int]]] = {
            s.writer: [] for s in scripts
        }

    def handle(self, command: Queued) -> None:
        writer = command.instance
        current = self.current[writer]
        if isinstance(command, Rdata):
            deliver = self.inbound.rdata(command, current)
            if deliver is not None:
                self.got[writer] += [(deliver.token, row) for row in deliver.rows]
                self.current[writer] = deliver.token
        elif isinstance(command, Position):
            self.follow(self.inbound.position(command, current))
        elif isinstance(command, Departure):
            self.inbound.departed(command)
            assert not self.inbound.is_connected(STREAM, writer)
            seen = (list(self.got[writer]), current)
            self.departures[writer] += [seen] * command.count
        else:
            assert isinstance(command, Resync), f"the scripts send no FENCED: {command}"
            self.follow(self.inbound.resync(command, current))

    def follow(self, plan: Plan | None) -> None:
        if plan is None:
            return
        writer = plan.instance
        if plan.catch_up_from is not None and plan.advance_to is not None:
            self.got[writer] += [
                (t, r) for t, r in self.rows[writer] if plan.catch_up_from < t <= plan.advance_to
            ]
        if plan.advance_to is not None:
            self.current[writer] = plan.advance_to
        self.inbound.caught_up(plan.stream, writer)


@given(st.data())
def test_a_connection_that_ends_leaves_every_row_it_named_delivered_once(
    data: st.DataObject,
) -> None:
    """The connection ends at any point (the writers may have departed: nothing is sent
    again): what waits in the backlog is drained, and the reader has each writer's rows
    up to the highest position that arrived, exactly once, in order; rows of a batch
    whose numbered row never arrived wait for that writer's next POSITION elsewhere."""
    count = data.draw(st.integers(1, len(WRITERS)), label="writers")
    all_scripts = [
        data.draw(scripts(w, first=i + 1), label=w) for i, w in enumerate(WRITERS[:count])
    ]
    bound = data.draw(st.integers(1, 6), label="bound")
    streams = [
        [Position(STREAM, s.writer, s.sent[0][1], s.sent[0][1]), *[c for c, _ in s.sent]]
        for s in all_scripts
    ]
    starts = {s.writer: s.sent[0][1] for s in all_scripts}
    named = dict(starts)  # the highest position each writer's arrived commands named
    reader = Reader(all_scripts, starts)
    backlog = Backlog(STREAM, bound)
    for _ in range(data.draw(st.integers(0, sum(map(len, streams))), label="arrivals")):
        i = data.draw(st.sampled_from([i for i, s in enumerate(streams) if s]), label="next")
        command = streams[i].pop(0)
        upto = command.new if isinstance(command, Position) else command.token
        if upto is not None:
            named[command.instance] = max(named[command.instance], upto)
        backlog.push(command)
        for _ in range(data.draw(st.integers(0, 2), label="handled")):
            if (queued := backlog.pop()) is not None:
                reader.handle(queued)
    backlog.ended()
    while (queued := backlog.pop()) is not None:
        reader.handle(queued)
    assert backlog.idle()

    for script in all_scripts:
        start, upto = starts[script.writer], named[script.writer]
        assert reader.got[script.writer] == [(t, r) for t, r in script.rows if start < t <= upto]
        assert reader.current[script.writer] == upto


@given(st.data())
def test_every_row_arrives_exactly_once_in_order_through_overflowing_backlogs(
    data: st.DataObject,
) -> None:
    count = data.draw(st.integers(1, len(WRITERS)), label="writers")
    writers = WRITERS[:count]
    all_scripts = [data.draw(scripts(w, first=i + 1), label=w) for i, w in enumerate(writers)]
    bound = data.draw(st.integers(1, 6), label="bound")

    # Each writer answers the reader's REPLICATE between two of its sends, never inside
    # a batch; the reader sees that writer's commands from there on, and had loaded
    # some position of it at start-up.
    streams: list[list[Rdata | Position]] = []
    starts: dict[str, int] = {}
    for script in all_scripts:
        joins = [
            i
            for i in range(len(script.sent))
            if i == 0 or not (isinstance(c := script.sent[i - 1][0], Rdata) and c.token is None)
        ]
        join = data.draw(st.sampled_from(joins), label=f"join {script.writer}")
        answer = script.sent[join][1]
        commands: list[Rdata | Position] = [Position(STREAM, script.writer, answer, answer)]
        streams.append(commands + [c for c, _ in script.sent[join:]])
        first = script.sent[0][1]
        starts[script.writer] = data.draw(
            st.sampled_from([first, *[t for t, _ in script.rows]]), label=f"start {script.writer}"
        )

    # The writers' commands interleave on the connection; the reader's worker takes
    # some of what waits after each arrival (none: it is slow, and the backlog fills).
    reader = Reader(all_scripts, starts)
    backlog = Backlog(STREAM, bound)
    overflows = 0
    while any(streams):
        i = data.draw(st.sampled_from([i for i, s in enumerate(streams) if s]), label="next")
        overflows += backlog.push(streams[i].pop(0))
        assert len(backlog) <= max(bound, count)
        for _ in range(data.draw(st.integers(0, 2), label="handled")):
            command = backlog.pop()
            if command is not None:
                reader.handle(command)
    while (command := backlog.pop()) is not None:
        reader.handle(command)
    assert backlog.idle()

    for script in all_scripts:
        start = starts[script.writer]
        assert reader.got[script.writer] == [(t, r) for t, r in script.rows if t > start]
        assert reader.current[script.writer] == max(start, script.sent[-1][1])


@given(st.data())
def test_a_departure_comes_after_the_writers_rows_through_overflowing_backlogs(
    data: st.DataObject,
) -> None:
    """Writers leave (DEPART) and come back (their answer to REPLICATE, then more
    rows); the reader's backlog overflows at random moments. Every row arrives once, in
    order; each departure is handled with every row of that life delivered, at or past
    the position that life ended at."""
    count = data.draw(st.integers(1, len(WRITERS)), label="writers")
    writers = WRITERS[:count]
    all_lives = {w: data.draw(lives(w, first=i + 1), label=w) for i, w in enumerate(writers)}
    bound = data.draw(st.integers(1, 6), label="bound")

    streams: list[list[Rdata | Position | Departure]] = []
    starts: dict[str, int] = {}
    for writer, its_lives in all_lives.items():
        commands: list[Rdata | Position | Departure] = []
        for n, life in enumerate(its_lives):
            answer = life.sent[0][1]  # to the reader's REPLICATE, or after a restart
            commands.append(Position(STREAM, writer, answer, answer))
            commands += [c for c, _ in life.sent]
            if n + 1 < len(its_lives) or data.draw(st.booleans(), label=f"{writer} leaves"):
                commands.append(Departure(STREAM, writer))
        streams.append(commands)
        first = its_lives[0]
        starts[writer] = data.draw(
            st.sampled_from([first.sent[0][1], *[t for t, _ in first.rows]]),
            label=f"start {writer}",
        )

    everything = [
        Script(w, [row for life in ls for row in life.rows], []) for w, ls in all_lives.items()
    ]
    reader = Reader(everything, starts)
    backlog = Backlog(STREAM, bound)
    while any(streams):
        i = data.draw(st.sampled_from([i for i, s in enumerate(streams) if s]), label="next")
        backlog.push(streams[i].pop(0))
        assert len(backlog) <= max(bound, 3 * count)
        for _ in range(data.draw(st.integers(0, 2), label="handled")):
            command = backlog.pop()
            if command is not None:
                reader.handle(command)
    while (command := backlog.pop()) is not None:
        reader.handle(command)
    assert backlog.idle()

    for writer, its_lives in all_lives.items():
        start = starts[writer]
        rows = [(t, r) for life in its_lives for t, r in life.rows if t > start]
        assert reader.got[writer] == rows
        end = max(start, its_lives[-1].sent[-1][1])
        assert reader.current[writer] == end
        departures = reader.departures[writer]
        assert len(departures) in (len(its_lives) - 1, len(its_lives))
        for life, (got, at) in zip(its_lives, departures, strict=False):
            left_at = max(start, life.sent[-1][1])
            # Every row of that life before its departure. (Not "and none of the next":
            # an overflow folds two departures of one writer into one `Departure`, so
            # the earlier one may be handled after the later life's rows; see inbound.)
            life_rows = [(t, r) for t, r in rows if t <= left_at]
            assert got[: len(life_rows)] == life_rows
            assert at >= left_at
        stayed = len(departures) < len(its_lives)
        assert reader.inbound.is_connected(STREAM, writer) == stayed


def test_a_departure_waits_behind_its_writers_commands_and_survives_an_overflow() -> None:
    backlog = Backlog(STREAM, bound=4)
    backlog.push(Rdata(STREAM, "a", 4, "x"))
    backlog.push(Rdata(STREAM, "b", 5, "y"))
    backlog.push(Departure(STREAM, "a"))
    assert backlog.pop() == Rdata(STREAM, "a", 4, "x")
    assert backlog.pop() == Rdata(STREAM, "b", 5, "y")
    assert backlog.pop() == Departure(STREAM, "a")

    backlog.push(Rdata(STREAM, "a", 7, "x"))
    backlog.push(Departure(STREAM, "a"))
    backlog.push(Position(STREAM, "a", 9, 9))  # back: its answer to REPLICATE
    backlog.push(Departure(STREAM, "a"))
    assert backlog.push(Position(STREAM, "a", 9, 9))  # back again: past the bound
    assert backlog.pop() == Resync(STREAM, "a", 9)
    assert backlog.pop() == Departure(STREAM, "a", count=2)
    assert backlog.pop() == Resync(STREAM, "a", 9)
    assert backlog.pop() is None


def test_a_writer_cut_inside_a_batch_that_departs_is_no_longer_cut() -> None:
    """Its batch never ends: the backlog drains and the fast path is back."""
    backlog = Backlog(STREAM, bound=2)
    backlog.push(Rdata(STREAM, "a", 4, "x"))
    backlog.push(Rdata(STREAM, "a", None, "y.0"))
    assert backlog.push(Rdata(STREAM, "a", None, "y.1"))  # cut inside the batch
    assert not backlog.idle()
    backlog.push(Departure(STREAM, "a"))
    assert backlog.pop() == Resync(STREAM, "a", 4)  # up to below the batch
    assert backlog.pop() == Departure(STREAM, "a")
    assert backlog.pop() is None
    assert backlog.idle()

    backlog.push(Rdata(STREAM, "b", None, "z.0"))
    backlog.push(Rdata(STREAM, "b", None, "z.1"))
    assert backlog.push(Departure(STREAM, "b"))  # overflows as it departs: no position
    assert backlog.pop() == Departure(STREAM, "b")
    assert backlog.idle()


def test_a_writer_cut_inside_a_batch_when_the_connection_ends_is_read_up_to_below_it() -> None:
    """No numbered row will end the batch on this connection: what the dropped commands
    named is read at once."""
    backlog = Backlog(STREAM, bound=2)
    backlog.push(Rdata(STREAM, "a", 4, "x"))
    backlog.push(Rdata(STREAM, "a", None, "y.0"))
    assert backlog.push(Rdata(STREAM, "a", None, "y.1"))  # cut inside the batch
    backlog.push(Rdata(STREAM, "b", None, "z.0"))
    backlog.push(Rdata(STREAM, "b", None, "z.1"))
    assert backlog.push(Rdata(STREAM, "b", None, "z.2"))  # cut, having named nothing
    backlog.ended()
    assert backlog.pop() == Resync(STREAM, "a", 4)
    assert backlog.pop() is None
    assert backlog.idle()


def test_an_overflow_keeps_one_resync_per_writer_at_its_highest_position() -> None:
    backlog = Backlog(STREAM, bound=3)
    assert not backlog.push(Rdata(STREAM, "a", 5, "x"))
    assert not backlog.push(Position(STREAM, "b", 2, 8))
    assert not backlog.push(Rdata(STREAM, "a", 7, "y"))
    assert backlog.push(Position(STREAM, "a", 7, 9))
    assert len(backlog) == 2
    assert backlog.pop() == Resync(STREAM, "a", 9)
    assert backlog.pop() == Resync(STREAM, "b", 8)
    assert backlog.pop() is None
    assert backlog.idle()


def test_a_writer_cut_inside_a_batch_resyncs_at_its_numbered_row() -> None:
    backlog = Backlog(STREAM, bound=2)
    backlog.push(Rdata(STREAM, "a", 4, "x"))
    backlog.push(Rdata(STREAM, "a", None, "y.0"))
    assert backlog.push(Rdata(STREAM, "a", None, "y.1"))  # cut inside the batch
    assert len(backlog) == 0
    assert not backlog.idle()  # nothing to hand out, yet nothing may skip the queue
    assert not backlog.push(Rdata(STREAM, "a", None, "y.2"))
    assert len(backlog) == 0
    backlog.push(Rdata(STREAM, "b", 3, "other"))  # other writers queue as usual
    backlog.push(Rdata(STREAM, "a", 6, "y.3"))  # the batch ends: read up to it
    assert backlog.pop() == Rdata(STREAM, "b", 3, "other")
    assert backlog.pop() == Resync(STREAM, "a", 6)
    assert backlog.idle()


def test_a_backwards_stream_resyncs_to_internal_positions() -> None:
    backlog = Backlog(STREAM, bound=1, sign=-1)
    backlog.push(Rdata(STREAM, "a", -5, "x"))
    assert backlog.push(Rdata(STREAM, "a", -7, "y"))
    assert backlog.pop() == Resync(STREAM, "a", 7)


def test_a_resync_forgets_held_rows_and_reads_only_when_behind() -> None:
    inbound = Inbound(own_name="me")
    inbound.caught_up(STREAM, "a")
    assert inbound.rdata(Rdata(STREAM, "a", None, "stale.0"), current=1) is None
    plan = inbound.resync(Resync(STREAM, "a", 9), current=4)
    assert plan == Plan(STREAM, "a", catch_up_from=4, advance_to=9)
    assert not inbound.is_connected(STREAM, "a")  # until the plan was done
    assert inbound.rdata(Rdata(STREAM, "a", 12, "ignored"), current=9) is None
    inbound.caught_up(STREAM, "a")
    deliver = inbound.rdata(Rdata(STREAM, "a", 12, "z"), current=9)
    assert deliver is not None
    assert deliver.rows == ["z"]  # not "stale.0" with it
    assert inbound.resync(Resync(STREAM, "a", 9), current=12) == Plan(STREAM, "a", None, None)


def test_a_backlog_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Backlog(STREAM, bound=0)


def test_the_bound_is_configured_with_one_default() -> None:
    config = InstanceConfig.load({"instance_name": "a"})
    assert config.replication.inbound_queue == DEFAULT_INBOUND_QUEUE == 10_000
    small = InstanceConfig.load({"instance_name": "a", "replication": {"inbound_queue": 50}})
    assert small.replication.inbound_queue == 50
    with pytest.raises(ConfigError, match="inbound_queue: Input should be greater than"):
        InstanceConfig.load({"instance_name": "a", "replication": {"inbound_queue": 0}})


_own_commands = st.one_of(
    st.builds(
        Rdata,
        st.just(STREAM),
        st.sampled_from(WRITERS),
        st.integers(1, 50) | st.none(),  # None: a batch row
        st.just("r"),
    ),
    st.builds(
        Position, st.just(STREAM), st.sampled_from(WRITERS), st.integers(1, 50), st.integers(1, 50)
    ),
)
_fences = st.builds(Fenced, st.just(STREAM), st.sampled_from(WRITERS), st.integers(1, 100))


@given(st.lists(_own_commands | _fences, max_size=40), st.integers(1, 6))
def test_a_fence_never_folds_into_a_writers_own_resync(
    pushed: list[Rdata | Position | Fenced], bound: int
) -> None:
    """A FENCED is another instance's word, which the shell checks against the database;
    a `Resync` is taken as the writer's own. Through any overflow the backlog keeps
    the highest fence per writer as a FENCED, and no Resync reaches past what the
    writer's own commands named."""
    backlog = Backlog(STREAM, bound=bound)
    for command in pushed:
        backlog.push(command)
    kept = []
    while (queued := backlog.pop()) is not None:
        kept.append(queued)
    for writer in WRITERS:
        own = [c for c in pushed if not isinstance(c, Fenced) and c.instance == writer]
        own_upto = max([c.new if isinstance(c, Position) else c.token or 0 for c in own], default=0)
        for queued in kept:
            if isinstance(queued, Resync) and queued.instance == writer:
                assert queued.upto <= own_upto
        fences = [c.position for c in pushed if isinstance(c, Fenced) and c.instance == writer]
        if fences:
            assert Fenced(STREAM, writer, max(fences)) in kept


def test_an_overflow_keeps_the_highest_fence_after_the_resyncs() -> None:
    backlog = Backlog(STREAM, bound=3)
    backlog.push(Rdata(STREAM, "a", 5, "x"))
    backlog.push(Fenced(STREAM, "a", 20))
    backlog.push(Fenced(STREAM, "a", 12))
    assert backlog.push(Position(STREAM, "a", 5, 9))
    assert [backlog.pop(), backlog.pop(), backlog.pop()] == [
        Resync(STREAM, "a", 9),
        Fenced(STREAM, "a", 20),
        None,
    ]
