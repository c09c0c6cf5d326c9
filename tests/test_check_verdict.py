"""The checker's judge, without processes: allowed positions, stalls, exactly once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.check.allowed import (
    DATABASE_GRACE,
    IDLE_GRACE,
    TRANSPORT_GRACE,
    History,
    allowed_positions,
    least,
)
from plait.check.error_lines import error_line, last_error, worker_start_timed_out
from plait.check.faults import FaultLog, counts_for, kinds_for, schedule
from plait.check.options import Options
from plait.check.plan import PG_SETTLE, postgres_fault_near
from plait.check.report import Report
from plait.check.spark_reader import Batches
from plait.check.verdict import (
    ReaderLog,
    ReaderVerdict,
    judge_reader,
    longest_stall,
)
from plait.errors import ConfigError

W = ["w0", "w1"]


def history(*events: tuple[float, str, str, list[int]], **extra: object) -> History:
    h = History(events={"s": list(events)}, starts={w: [0.0] for w in W})
    for name, value in extra.items():
        setattr(h, name, value)
    return h


def at(steps: list[tuple[float, int]], t: float) -> int:
    """The position a step function holds at time t."""
    value = 0
    for when, p in steps:
        if when <= t:
            value = max(value, p)
    return value


def test_a_slow_commit_holds_the_linear_position_without_a_stall() -> None:
    # w1 takes 2 and keeps it open for 10 s; w0 takes 1, 3, 4 and commits them at once.
    h = history(
        (1.0, "w0", "A", [1]),
        (1.1, "w1", "A", [2]),
        (1.2, "w0", "A", [3, 4]),
        (1.3, "w0", "C", [1]),
        (1.4, "w0", "C", [3, 4]),
        (11.0, "w1", "C", [2]),
    )
    linear = least(allowed_positions(h, "s", W))
    # w1 is at its registration (0) while 2 is open: from positions alone nobody can
    # tell that 1 is not w1's, so nothing passes (R-ID-3) and nothing counts as a stall.
    assert at(linear, 5.0) == 0
    assert at(linear, 11.0) == 2
    assert at(linear, 11.0 + IDLE_GRACE) == 4  # w1 idle: at the head a grace later
    # A reader that passes 4 at 12.2 trailed by 0.2 s; one that passes it at 17, by 5.
    stall, at_id = longest_stall(linear, [(11.1, 2), (12.2, 4)], [1, 2, 3, 4])
    assert (round(stall, 3), at_id) == (0.2, 3)
    stall, at_id = longest_stall(linear, [(11.1, 2), (17.0, 4)], [1, 2, 3, 4])
    assert (round(stall, 3), at_id) == (5.0, 3)


def test_a_fetch_on_its_way_holds_the_writer_below_what_it_may_return() -> None:
    # w1 asks for IDs at 2.0 and is paused before they arrive (at 4.0: 3, taken after
    # w0's 2); 3 stays open 10 s. w1 never looked idle meanwhile, so nothing passes 1
    # until 3 commits: a reader held there did not stall.
    h = history(
        (0.1, "w0", "A", [1]),
        (0.2, "w0", "C", [1]),
        (2.0, "w1", "F", [7]),
        (2.1, "w0", "A", [2]),
        (2.2, "w0", "C", [2]),
        (4.0, "w1", "f", [7]),
        (4.0, "w1", "A", [3]),
        (14.0, "w1", "C", [3]),
    )
    linear = least(allowed_positions(h, "s", W))
    assert at(linear, 13.9) == 1  # w1 idle at 1 before its fetch, then held
    assert at(linear, 14.0) == 3
    # Without the fetch in the journal, w1 looks idle and 2 is allowed a grace later.
    blind = [e for e in h.events["s"] if e[2] not in ("F", "f")]
    blind_linear = least(allowed_positions(history(*blind), "s", W))
    assert at(blind_linear, 3.5) == 2
    # A reader that passed 1 at 1.3 and the rest when 3 committed: no stall, but to the
    # blind judge 2 waited some 10 s.
    reader = [(1.3, 1), (14.0, 3)]
    assert longest_stall(linear, reader, [1, 2, 3])[0] < 0.2
    assert longest_stall(blind_linear, reader, [1, 2, 3]) > (10.0, 2)


def test_a_dead_writer_may_be_fenced_to_the_others_position() -> None:
    h = history(
        (1.0, "w0", "A", [1]),
        (1.1, "w1", "A", [2]),
        (1.2, "w1", "C", [2]),
        (1.3, "w1", "A", [3]),
        (1.4, "w1", "C", [3]),
        deaths={"w0": [2.0]},  # w0 dies with 1 in flight
    )
    steps = allowed_positions(h, "s", W)
    assert at(least(steps), 1.9) == 0
    assert at(least(steps), 2.0) == 3


def test_with_every_writer_dead_only_rows_that_exist_may_be_passed() -> None:
    # A fence moves a dead writer to the others' highest position or its own last
    # row, never over IDs in flight when everyone died: 3 stays unpassable.
    h = history(
        (1.0, "w0", "A", [1]),
        (1.1, "w1", "A", [2]),
        (1.2, "w1", "C", [2]),
        (1.3, "w0", "A", [3]),
        deaths={"w0": [2.0], "w1": [1.5]},
    )
    linear = least(allowed_positions(h, "s", W))
    assert at(linear, 1.9) == 0
    assert at(linear, 100.0) == 2


def test_a_paused_writer_publishes_when_it_runs_again() -> None:
    h = history(
        (1.0, "w0", "A", [1]),
        (1.1, "w0", "C", [1]),
        (1.0, "w1", "A", [2]),
        (1.2, "w1", "C", [2]),
        stops={"w0": [(1.5, 4.0)]},  # paused 0.4 s after committing 1
    )
    steps = allowed_positions(h, "s", W)
    assert at(steps["w0"], 3.9) == 0
    assert at(steps["w0"], 4.0) >= 1


def test_a_partitioned_writer_holds_until_its_connections_end_then_may_be_fenced() -> None:
    # w1 holds 2 (open) when its database connections are black-holed at 2.0; they end
    # at 8.0 (the keepalive bound), the partition heals at 11.0. w0 commits 1, 3, 4.
    # Nothing passes 2 before 8.0 (nor 1: w1 is at its registration, R-ID-3): a live
    # writer cut off cannot be fenced while its server processes live. From 8.0 it is
    # dead, where a fence may move it.
    h = history(
        (1.0, "w0", "A", [1]),
        (1.1, "w0", "C", [1]),
        (1.5, "w1", "A", [2]),
        (1.6, "w0", "A", [3, 4]),
        (1.7, "w0", "C", [3, 4]),
        partitions={"w1": [(2.0, 8.0, 11.0)]},
    )
    linear = least(allowed_positions(h, "s", W))
    assert at(linear, 7.9) == 0
    assert at(linear, 8.0) == 4
    # A reader that passes 4 one second after the cut trailed by one second, not seven.
    stall, at_id = longest_stall(linear, [(1.2, 1), (9.0, 4)], [1, 3, 4])
    assert (round(stall, 3), at_id) == (1.0, 3)


def test_a_partitioned_writer_is_fenced_only_while_postgresql_is_up() -> None:
    # As above, but PostgreSQL crashes 0.8 s after the cut (before anyone could fence
    # w1: fence_after and a scan) and is back at 10.5; the partition heals at 11.0,
    # before a fence could follow: w1 is never fenced and goes on alive, its open
    # transaction holding it until it ends at 15.0 (seen in a run: 10 s of a slow
    # commit counted as a stall).
    def h(db_outages: list[tuple[float, float]], healed: float = 11.0) -> History:
        return history(
            (1.0, "w0", "A", [1]),
            (1.1, "w0", "C", [1]),
            (1.5, "w1", "A", [2]),
            (1.6, "w0", "A", [3, 4]),
            (1.7, "w0", "C", [3, 4]),
            (30.0, "w1", "E", [2]),
            partitions={"w1": [(2.0, 8.0, healed)]},
            db_outages=db_outages,
        )

    linear = least(allowed_positions(h([(8.8, 10.5)]), "s", W))
    assert at(linear, 29.9) == 0
    assert at(linear, 30.0) == 2
    assert at(linear, 30.0 + IDLE_GRACE) == 4
    # The fencers reconnect within the outage's grace: a heal then leaves w1 unfenced.
    back = 9.0
    fence = back + DATABASE_GRACE  # the latest a fence may come after the outage
    assert at(least(allowed_positions(h([(8.8, back)]), "s", W)), 29.9) == 0
    # A partition that lasts past that and a scan: w1 may be fenced from then on.
    linear = least(allowed_positions(h([(8.8, back)], healed=fence + 2.5), "s", W))
    assert at(linear, fence - 0.1) == 0
    assert at(linear, fence) == 4
    # An outage long before the cut, or once a fence could be done, moves nothing.
    for outage in [(2.0, 3.0), (11.0, 11.5)]:
        linear = least(allowed_positions(h([outage], healed=20.0), "s", W))
        assert at(linear, 8.0) == 4


def test_a_stall_names_the_writers_that_held_the_reader_back() -> None:
    # w1 held 2 open until 9.0; the reader's views (as it journals them, when they
    # change) show w1 below 2 from the stall's start to its end.
    h = history(
        (1.0, "w0", "A", [1]),
        (1.1, "w1", "A", [2]),
        (1.2, "w0", "C", [1]),
        (1.3, "w0", "A", [3]),
        (1.4, "w0", "C", [3]),
        deaths={"w1": [2.0]},
    )
    log = ReaderLog(
        rows={("s", "*"): [1, 2, 3]},
        tokens={("s", "*"): [(1.3, 1), (9.0, 3)]},
        caught_up=True,
        views={
            "s": [
                (0.5, {"w0": 0, "w1": 0}),
                (1.5, {"w0": 3, "w1": 1}),
                (9.0, {"w0": 3, "w1": 3}),
            ]
        },
    )
    verdict = judge_reader(
        "linear",
        log,
        {"s": {1: "w0", 2: "w1", 3: "w0"}},
        {"s": allowed_positions(h, "s", W)},
        per_writer=False,
    )
    assert verdict.stall_at == "s:2"
    assert verdict.held_by == "held back by w1 at 1"
    assert verdict.violations(4.0) == ["stall 7.00 s > 4 s at s:2 (held back by w1 at 1)"]


def test_a_partitioned_writer_could_not_publish_what_it_did_just_before() -> None:
    # w1 commits 2 just before the partition: it publishes through the database (it
    # reads its rows back to send them), so nothing may count on 2 before the cut.
    h = history(
        (1.0, "w0", "A", [1]),
        (1.1, "w0", "C", [1]),
        (1.5, "w1", "A", [2]),
        (1.6, "w0", "A", [3]),
        (1.7, "w0", "C", [3]),
        (1.95, "w1", "C", [2]),
        (1.96, "w1", "F", [9]),  # its next fetch waits for the partition
        partitions={"w1": [(2.0, 8.0, 11.0)]},
    )
    steps = allowed_positions(h, "s", W)
    assert at(steps["w1"], 7.9) == 0
    assert at(least(steps), 8.0) == 3


def test_a_writer_killed_behind_a_partition_is_fenced_only_once_it_ends() -> None:
    # Its connections' ends were held by the partition too: the server sees them alive
    # until the cut, whatever happened to the process.
    h = history(
        (1.0, "w0", "A", [1]),
        (1.1, "w0", "C", [1]),
        (1.5, "w1", "A", [2]),
        (1.6, "w0", "A", [3]),
        (1.7, "w0", "C", [3]),
        deaths={"w1": [4.0]},
        partitions={"w1": [(2.0, 8.0, 11.0)]},
    )
    linear = least(allowed_positions(h, "s", W))
    assert at(linear, 7.9) == 0
    assert at(linear, 8.0) == 3
    # Healed, a killed writer stays dead until it starts again.
    h.starts["w1"].append(12.0)
    h.events["s"] += [(11.5, "w0", "A", [5]), (11.6, "w0", "C", [5])]
    assert at(least(allowed_positions(h, "s", W)), 11.9) == 5


def test_a_healed_writer_is_alive_again_and_holds_what_it_takes() -> None:
    # Healed at 11.0 (fenced meanwhile), w1 goes on: its fetch on its way since the
    # partition returns 6 at 11.2, open until 20.0. Nothing passes 6 before that.
    h = history(
        (1.0, "w0", "A", [1]),
        (1.1, "w0", "C", [1]),
        (1.5, "w1", "A", [2]),
        (1.6, "w0", "A", [3]),
        (1.7, "w0", "C", [3]),
        (7.0, "w1", "F", [9]),
        (11.2, "w1", "f", [9]),
        (11.2, "w1", "A", [6]),
        (11.3, "w0", "A", [7]),
        (11.4, "w0", "C", [7]),
        (20.0, "w1", "C", [6]),
        partitions={"w1": [(2.0, 8.0, 11.0)]},
    )
    linear = least(allowed_positions(h, "s", W))
    assert at(linear, 8.0) == 3
    assert at(linear, 19.9) == 3
    assert at(linear, 20.0) == 6
    assert at(linear, 20.0 + IDLE_GRACE) == 7  # idle again: at the head a grace later


def test_a_writer_idles_only_while_it_runs() -> None:
    # w0 starts at 1.0 and is paused at once until 4.0: it could not learn of w1's IDs
    # nor publish an advance meanwhile. At 4.0 it takes 5 and holds it (a slow commit):
    # the linear position stays at w0's start until 5 completes (seen in a run: a
    # writer paused as it started, then given slow commits).
    h = history(
        (0.5, "w1", "A", [1]),
        (0.6, "w1", "C", [1]),
        (1.5, "w1", "A", [2, 3, 4]),
        (1.6, "w1", "C", [2, 3, 4]),
        (4.0, "w0", "F", [0]),
        (4.01, "w0", "f", [0]),
        (4.01, "w0", "A", [5]),
        (14.0, "w0", "C", [5]),
        starts={"w0": [1.0], "w1": [0.0]},
        stops={"w0": [(1.0, 4.0)]},
    )
    linear = least(allowed_positions(h, "s", W))
    assert at(linear, 13.9) == 1
    assert at(linear, 14.0) >= 5
    # Paused after a second of running idle, it would have advanced before the pause.
    h.stops = {"w0": [(2.9, 4.0)]}
    assert at(least(allowed_positions(h, "s", W)), 4.0) >= 4


def test_an_idle_writer_moves_to_the_head_only_after_the_grace() -> None:
    h = history(
        (1.0, "w1", "A", [1]),
        (1.1, "w1", "C", [1]),
        (5.0, "w1", "A", [2]),
    )
    steps = allowed_positions(h, "s", W)
    # w0 has been idle since its start; the head became 1 at 1.0, so w0 may follow it
    # a grace later, not before.
    assert at(steps["w0"], 1.0 + IDLE_GRACE - 0.15) == 0
    assert at(steps["w0"], 1.0 + IDLE_GRACE + 0.15) == 1


@st.composite
def histories(draw: st.DrawFn) -> tuple[History, dict[str, set[int]]]:
    """Random takes (some through a fetch journalled before its IDs arrive) and settles
    of two writers; returns the history and, per writer, what it still holds at the
    end: its open IDs, and for an open fetch the lowest ID it could return."""
    next_id, t = 1, 0.0
    held: dict[str, set[int]] = {w: set() for w in W}
    fetches: dict[str, dict[int, int]] = {w: {} for w in W}  # serial -> floor
    events: list[tuple[float, str, str, list[int]]] = []
    for serial in range(draw(st.integers(1, 40))):
        t += draw(st.floats(0.01, 2.0))
        w = draw(st.sampled_from(W))
        action = draw(st.sampled_from(["settle", "take", "fetch", "arrive"]))
        if action == "settle" and held[w]:
            i = draw(st.sampled_from(sorted(held[w])))
            held[w].discard(i)
            events.append((t, w, draw(st.sampled_from("CRE")), [i]))
        elif action == "fetch":
            fetches[w][serial] = next_id
            events.append((t, w, "F", [serial]))
        else:
            if action == "arrive" and fetches[w]:
                began = draw(st.sampled_from(sorted(fetches[w])))
                del fetches[w][began]
                events.append((t, w, "f", [began]))
            n = draw(st.integers(1, 3))
            ids = list(range(next_id, next_id + n))
            next_id += n
            held[w].update(ids)
            events.append((t, w, "A", ids))
    for w in W:
        held[w].update(fetches[w].values())
    return history(*events), held


@settings(max_examples=300, deadline=None)
@given(histories())
def test_the_allowed_position_never_passes_an_open_id(
    case: tuple[History, dict[str, set[int]]],
) -> None:
    h, held = case
    steps = allowed_positions(h, "s", W)
    open_ids = [i for ids in held.values() for i in ids]
    linear = least(steps)
    assert [p for _, p in linear] == sorted(p for _, p in linear)
    if open_ids:
        assert at(linear, 1e9) < min(open_ids)
    for w, ids in held.items():
        if ids:
            assert at(steps[w], 1e9) < min(ids)


def test_judging_counts_lost_duplicated_and_phantom_rows() -> None:
    committed = {"s": {1: "w0", 2: "w1", 3: "w0"}}
    log = ReaderLog(rows={("s", "*"): [1, 1, 3, 9]}, caught_up=True)
    verdict = judge_reader("r", log, committed, None, per_writer=False)
    assert (verdict.lost, verdict.duplicated, verdict.phantom) == (1, 1, 1)
    assert verdict.violations(4.0) == ["lost: 1", "duplicated: 1", "phantom: 1"]
    # Rows journalled under the wrong writer are phantoms too.
    log = ReaderLog(rows={("s", "w1"): [1], ("s", "w0"): [3]}, caught_up=True)
    assert judge_reader("r", log, committed, None, per_writer=True).phantom == 1


def test_a_transport_outage_is_not_a_stall_of_a_replication_reader() -> None:
    h = history((1.0, "w0", "A", [1]), (1.1, "w0", "C", [1]))
    allowed = {"s": allowed_positions(h, "s", W)}
    ((ready, _),) = least(allowed["s"])  # when 1 may be passed
    committed = {"s": {1: "w0"}}
    late = ReaderLog(rows={("s", "*"): [1]}, tokens={("s", "*"): [(ready + 9.0, 1)]})
    # Redis was down 3 s of those 9 (and then reconnecting for TRANSPORT_GRACE), in
    # two overlapping restarts: only the rest counts.
    outages = [(ready + 1.0, ready + 3.0), (ready + 2.0, ready + 4.0)]
    reader = judge_reader("linear", late, committed, allowed, per_writer=False, outages=outages)
    assert round(reader.longest_stall, 3) == round(9.0 - 3.0 - TRANSPORT_GRACE, 3)
    alone = judge_reader("dblinear", late, committed, allowed, per_writer=False)
    assert round(alone.longest_stall, 3) == 9.0


def test_a_postgresql_outage_excuses_every_readers_stall_but_never_a_row() -> None:
    h = history((1.0, "w0", "A", [1, 2]), (1.1, "w0", "C", [1, 2]))
    allowed = {"s": allowed_positions(h, "s", W)}
    ((ready, _),) = least(allowed["s"])
    committed = {"s": {1: "w0", 2: "w0"}}
    # 2 is read twice and 1 never, 9 s after it may be: PostgreSQL was down 2 s of those.
    late = ReaderLog(rows={("s", "*"): [2, 2]}, tokens={("s", "*"): [(ready + 9.0, 2)]})
    down = [(ready + 1.0, ready + 3.0)]
    reader = judge_reader("dblinear", late, committed, allowed, per_writer=False, db_outages=down)
    assert round(reader.longest_stall, 3) == round(9.0 - 2.0 - DATABASE_GRACE, 3)
    assert (reader.lost, reader.duplicated) == (1, 1)
    assert reader.violations(4.0)[:2] == ["lost: 1", "duplicated: 1"]
    # With a transport outage too, overlapping windows are left out once.
    both = judge_reader(
        "linear", late, committed, allowed, per_writer=False, outages=down, db_outages=down
    )
    assert round(both.longest_stall, 3) == round(reader.longest_stall, 3)


def test_a_readers_death_is_named_next_to_its_losses() -> None:
    committed = {"s": {1: "w0", 2: "w0"}}
    log = ReaderLog(rows={("s", "*"): [1]})
    cause = "a query failed: psycopg.OperationalError: the database system is shutting down"
    verdict = judge_reader("spark", log, committed, None, per_writer=False, died=cause)
    assert verdict.violations(15.0) == ["lost: 1", f"stopped reading: {cause}", "did not catch up"]


def test_the_last_error_of_a_log_is_its_exception_or_error_line() -> None:
    traceback = (
        "2026-01-01 10:00:00,000 spark INFO plait.check: s0 batch 3: 10 rows in 0.2 s\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "psycopg.OperationalError: connection failed: too many clients\n"
        "\n"
    )
    assert last_error(traceback) == "psycopg.OperationalError: connection failed: too many clients"
    spark = "10:00:01 ERROR MicroBatchExecution: Query check-s0 terminated with error\nat x\n"
    assert (
        last_error(spark)
        == "10:00:01 ERROR MicroBatchExecution: Query check-s0 terminated with error"
    )
    assert last_error("only this\n") == "only this"
    assert last_error("") == ""


def test_only_linear_stalls_are_bounded() -> None:
    h = history((1.0, "w0", "A", [1]), (1.1, "w0", "C", [1]))
    allowed = {"s": allowed_positions(h, "s", W)}
    committed = {"s": {1: "w0"}}
    late = ReaderLog(rows={("s", "*"): [1]}, tokens={("s", "*"): [(9.0, 1)]}, caught_up=True)
    linear = judge_reader("linear", late, committed, allowed, per_writer=False)
    assert linear.longest_stall > 4.0
    assert linear.violations(4.0)[0].startswith("stall")
    late = ReaderLog(rows={("s", "w0"): [1]}, tokens={("s", "w0"): [(9.0, 1)]}, caught_up=True)
    follower = judge_reader("follower", late, committed, allowed, per_writer=True)
    assert follower.longest_stall > 4.0
    assert follower.violations(4.0) == []


def test_the_schedule_has_every_kind_in_the_run() -> None:
    kinds = kinds_for("tcp")
    assert "redis_restart" not in kinds
    assert "spark_restart" not in kinds
    assert "redis_restart" in kinds_for("redis")
    assert "spark_restart" in kinds_for("tcp", spark=True)
    plan = schedule(counts_for(kinds, 20), 30.0, random.Random(1))
    assert len(plan) == 20 * (len(kinds) - 1) + 2  # a tenth as many partitions
    assert all(1.0 <= t <= 29.0 for t, _ in plan)
    assert plan == sorted(plan)


def test_a_partition_is_a_tenth_as_often_on_any_server_and_ends_in_the_run() -> None:
    # One writer's connections only: also against a server the user named.
    assert "pg_partition" in kinds_for("tcp")
    assert "pg_partition" in Options(dsn="postgresql://db/x").fault_counts
    kinds = kinds_for("redis", postgres=True)
    assert counts_for(kinds, 20)["pg_partition"] == 2
    assert counts_for(kinds, 3)["pg_partition"] == 1
    counts = {"pg_partition": 50, "kill": 50}
    plan = schedule(counts, 25.0, random.Random(3), {"pg_partition": 10.0})
    partitions = [t for t, kind in plan if kind == "pg_partition"]
    assert len(partitions) == 50
    assert all(1.0 <= t <= 14.0 for t in partitions)  # over before the last second
    assert max(t for t, kind in plan if kind == "kill") > 14.0
    # A run too short for one still has it, as early as may be.
    assert schedule({"pg_partition": 1}, 8.0, random.Random(4), {"pg_partition": 10.0}) == [
        (1.0, "pg_partition")
    ]


def test_a_run_may_ask_for_some_kinds_only() -> None:
    assert set(Options(kinds=("pg_partition",), faults=20).fault_counts) == {"pg_partition"}
    assert Options(kinds=("kill", "pg_crash")).fault_counts == {"kill": 20, "pg_crash": 2}
    with pytest.raises(ConfigError, match="unknown fault kind pg_flood"):
        Options(kinds=("pg_flood",))
    with pytest.raises(ConfigError, match="cannot have pg_crash"):
        Options(dsn="postgresql://db/x", kinds=("pg_crash",))
    with pytest.raises(ConfigError, match="cannot have redis_restart"):
        Options(transport="tcp", kinds=("redis_restart",))


def test_postgresql_faults_need_a_server_of_the_checkers_own() -> None:
    assert not {"pg_restart", "pg_crash"} & set(kinds_for("tcp"))
    kinds = kinds_for("tcp", postgres=True)
    assert {"pg_restart", "pg_crash"} <= set(kinds)
    counts = counts_for(kinds, 20)
    assert (counts["pg_restart"], counts["pg_crash"], counts["kill"]) == (2, 2, 20)
    assert counts_for(kinds, 3)["pg_crash"] == 1
    # Its own server: on by default; a server the user named: off, and refused if asked.
    assert Options().postgres_faults
    assert "pg_crash" in Options().fault_counts
    assert not Options(dsn="postgresql://db/x").postgres_faults
    assert not Options(pg_faults=False).postgres_faults
    with pytest.raises(ConfigError, match="only a server it started"):
        Options(dsn="postgresql://db/x", pg_faults=True)


def test_spark_queries_restart_a_quarter_as_often_and_at_least_once() -> None:
    kinds = kinds_for("redis", spark=True)
    counts = counts_for(kinds, 20)
    assert counts["spark_restart"] == 5
    assert all(n == 20 for k, n in counts.items() if k not in ("spark_restart", "pg_partition"))
    assert counts_for(kinds, 3)["spark_restart"] == 1
    plan = schedule(counts, 30.0, random.Random(2))
    assert sum(kind == "spark_restart" for _, kind in plan) == 5


def test_the_spark_sink_takes_a_batch_once_and_knows_a_replay_that_differs() -> None:
    batches = Batches()
    rows = [("w0", 3), ("w1", 4)]
    assert batches.first_time("s0", 0, rows) is True
    assert batches.first_time("s1", 0, [("w0", 5)]) is True  # batch ids are per query
    assert batches.first_time("s0", 0, list(reversed(rows))) is False  # a replay, same rows
    assert batches.first_time("s0", 0, [("w0", 3)]) is None  # a replay reading other rows
    assert batches.first_time("s0", 1, []) is True


def test_a_failure_near_a_postgresql_fault_is_its_effect() -> None:
    control: dict[str, object] = {"pg_down": [[10.0, 12.0]]}
    assert postgres_fault_near(control, 11.0)
    assert postgres_fault_near(control, 12.0 + PG_SETTLE)
    assert not postgres_fault_near(control, 12.1 + PG_SETTLE)
    control = {"pg_down": [[10.0, 12.0], [30.0, None]]}
    assert postgres_fault_near(control, 500.0)  # one is still under way
    assert not postgres_fault_near({}, 11.0)


def test_a_spark_error_is_named_by_its_cause() -> None:
    error = (
        "[PYTHON_STREAMING_DATA_SOURCE_RUNTIME_ERROR] Failed when Python streaming data"
        " source perform latestOffset: Traceback (most recent call last):\n"
        "pyspark.errors.exceptions.captured.PythonException: thrown from the worker:\n"
        '  File "source.py", line 3, in latestOffset\n'
        "plait.errors.ConfigError: plait source: cannot connect to the database\n"
        "\tat org.apache.spark.sql.errors.QueryExecutionErrors$.x(QueryExecutionErrors.scala:1)\n"
    )
    assert error_line(error).endswith(
        "... plait.errors.ConfigError: plait source: cannot connect to the database"
    )
    assert error_line("stopped") == "stopped"


def test_a_python_worker_that_did_not_connect_back_is_told_apart() -> None:
    # What CI's failed run said (a loaded machine): the query is restarted, not a death.
    spark_said = (
        "org.apache.spark.SparkException: Python worker failed to connect back.\n"
        "\tat org.apache.spark.api.python.PythonWorkerFactory.createSimpleWorker"
    )
    assert worker_start_timed_out(spark_said)
    assert not worker_start_timed_out(
        "plait.errors.ConfigError: plait source: cannot connect to the database"
    )


def test_the_long_kinds_take_their_own_count_when_given() -> None:
    kinds = kinds_for("redis", spark=True, postgres=True)
    counts = counts_for(kinds, 100, long_per_kind=100)
    assert set(counts.values()) == {100}
    assert counts_for(kinds, 100)["pg_crash"] == 10
    assert counts_for(kinds, 100)["spark_restart"] == 25


def test_a_healed_writer_keeps_the_position_of_its_last_fence_not_the_others_at_the_heal() -> None:
    """The long run's stall on s1: w1 cut off while w0 writes on; it heals as a new
    incarnation where the fences left it, which trail the others (they fence to what
    they heard, and it registers at no head), then takes an ID and holds it. The judge
    put it at w0's position at the heal, and counted the reader's wait for w1's real
    position as a 7.9 s stall."""
    events = [(1.0, "w0", "A", [1]), (1.1, "w0", "C", [1])]
    for i in range(2, 60):  # w0 commits one ID every 0.2 s, up to 11.6 s
        events += [(i * 0.2, "w0", "A", [i]), (i * 0.2 + 0.01, "w0", "C", [i])]
    # w1 heals at 9.0 and takes 60 at 9.1, committed only at 15.0.
    events += [(9.1, "w1", "A", [60]), (15.0, "w1", "C", [60])]
    h = history(*events, partitions={"w1": [(2.0, 5.0, 9.0)]})
    linear = least(allowed_positions(h, "s", W))
    # Healed at 9.0, w1 is at most where a fence of FENCE_LAG before could put it: what
    # w0 had at 7.0 (34: 35 committed at 7.01), not the 44 w0 had at 9.0.
    assert at(linear, 14.9) == 34
    assert at(linear, 15.0) == 60  # 60 committed, and w0 idle at the head


def test_a_writer_is_partitioned_from_the_hole_until_it_heals() -> None:
    faults = FaultLog()
    assert not faults.partitioned_now("w1")
    partition = faults.partitioned("w1", 2.0)
    assert faults.partitioned_now("w1")
    assert not faults.partitioned_now("w0")
    partition.cut = 8.0  # its connections dropped: still cut off
    assert faults.partitioned_now("w1")
    partition.healed = 11.0
    assert not faults.partitioned_now("w1")


def test_a_reports_stalls_are_judged_at_the_bound_given_and_its_findings_whatever_it_is(
    tmp_path: Path,
) -> None:
    """`Report.problems_at(stretch)`: a stall past its bound (with the faults around it)
    fails the run at that bound only; a lost row fails it at any."""
    options = Options(dsn="postgresql://db/x", stall_bound=4.0)
    stalled = ReaderVerdict("linear", longest_stall=5.0, stall_at="s0:17", stall_span=(1.0, 6.0))
    lossy = ReaderVerdict("worker", lost=2)
    report = Report(
        options=options,
        seed=1,
        run_dir=tmp_path,
        elapsed=1.0,
        committed=10,
        rolled_back=0,
        failed=0,
        faults=FaultLog(),
        readers=[stalled, lossy],
        own_regressions=[],
        findings=["worker: lost: 2"],
        stall_context={"linear": "the stall lasted from 1.0 s to 6.0 s"},
    )
    assert report.problems == [
        "worker: lost: 2",
        "linear: stall 5.00 s > 4 s at s0:17",
        "linear: the stall lasted from 1.0 s to 6.0 s",
    ]
    assert report.problems_at(1.5) == ["worker: lost: 2"]  # 5 s fits 6 s
    assert not report.ok
    report.findings.clear()
    assert not report.ok  # the stall alone
    assert report.problems_at(1.3) == []
