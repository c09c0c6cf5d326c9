"""Judging a checker run: every reader's journal against what was committed and what
the faults allowed (`verdict`), into the run's `Report`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from plait.check import journal
from plait.check.allowed import History, allowed_positions
from plait.check.faults import FaultLog
from plait.check.journal import Kind
from plait.check.options import Options
from plait.check.plan import FOLLOWER, REPLICATION_READERS, SPARK, WORKER, Plan
from plait.check.report import Report
from plait.check.verdict import (
    ReaderLog,
    judge_reader,
    own_regressions,
)

# How far before a stall a failed run's report looks for the faults that may explain it.
STALL_CONTEXT = 5.0
# Journal lines that carry a fetch's IDs: arrived, committed, rolled back, failed.
_SETTLED_OR_ARRIVED = frozenset({Kind.ARRIVED, Kind.COMMITTED, Kind.ROLLED_BACK, Kind.FAILED})


@dataclass(frozen=True, slots=True)
class Run:
    """What judging needs of the run itself."""

    options: Options
    seed: int
    faults: FaultLog
    faults_began: float  # time.time() when the schedule started
    keepalive_bound: float


def judge(
    run: Run,
    plan: Plan,
    truth: dict[str, dict[int, str]],
    kv_truth: dict[str, dict[int, str]],
    elapsed: float,
    died: dict[str, str],
) -> Report:
    """The run's report: each reader's journal judged against what was committed (`truth`,
    and `kv_truth` for the cache worker) and against what the faults allowed."""
    options, faults = run.options, run.faults
    for line in journal.read(plan.journal(SPARK)):
        if line.kind == Kind.STATE and line.fields[0] == "reviving":
            faults.revived.append(" ".join(line.fields[2:]))
    history = History(
        db_outages=faults.db_outages,
        fence_after=options.fence_after,
        deaths=faults.deaths,
        stops=faults.stops,
        partitions={
            w: [(p.hole, p.cut, p.healed) for p in partitions]
            for w, partitions in faults.partitions.items()
        },
    )
    rolled_back = failed = renewed = 0
    for w in plan.writers:
        for line in journal.read(plan.journal(w)):
            if line.kind == Kind.FETCH:  # a fetch of IDs began
                s, fetch = line.fields[0], int(line.fields[1])
                history.events.setdefault(s, []).append((line.t, w, "F", [fetch]))
            elif line.kind in _SETTLED_OR_ARRIVED:
                s, ids = line.fields[0], journal.id_list(line.fields[1])
                events = history.events.setdefault(s, [])
                if line.kind == Kind.ARRIVED:  # the fetch ended; its IDs, if any, are open
                    events.append((line.t, w, "f", [int(line.fields[2])]))
                if ids:
                    events.append((line.t, w, line.kind, ids))
                rolled_back += len(ids) if line.kind == Kind.ROLLED_BACK else 0
                failed += len(ids) if line.kind == Kind.FAILED else 0
            elif line.kind == Kind.POSITION:
                positions = history.own_positions.setdefault((w, line.fields[0]), [])
                positions.append(int(line.fields[1]))
            elif line.kind == Kind.STATE and line.fields[0] == "started":
                history.starts.setdefault(w, []).append(line.t)
            elif line.kind == Kind.STATE and line.fields[0] == "renewed":
                renewed += 1
    allowed = {s: allowed_positions(history, s, plan.writers) for s in plan.stream_names}
    verdicts = [
        judge_reader(
            name,
            _reader_log(plan.journal(name)),
            kv_truth,
            None,
            per_writer=False,
            died=died.get(name, ""),
        )
        if name == WORKER
        else judge_reader(
            name,
            _reader_log(plan.journal(name)),
            truth,
            allowed,
            per_writer=name == FOLLOWER,
            outages=_down(plan, faults, name),
            db_outages=faults.db_outages,
            died=died.get(name, ""),
        )
        for name in options.readers
    ]
    regressions = own_regressions(history)
    problems = [f"{v.name}: {p}" for v in verdicts for p in v.findings()]
    problems += [f"{v.name}: e.g. {e}" for v in verdicts for e in v.examples]
    problems += [f"own position went back: {r}" for r in regressions]
    problems += [f"crash: {c}" for c in faults.crashes]
    return Report(
        options=options,
        seed=run.seed,
        run_dir=plan.run_dir,
        elapsed=elapsed,
        committed=sum(len(rows) for rows in truth.values()),
        rolled_back=rolled_back,
        failed=failed,
        faults=faults,
        readers=verdicts,
        own_regressions=regressions,
        findings=problems,
        stall_context={
            v.name: _faults_around(plan, run.faults_began, v.stall_span)
            for v in verdicts
            if v.stall_span[1] > 0
        },
        renewed=renewed,
        keepalive_bound=run.keepalive_bound,
    )


def _down(plan: Plan, faults: FaultLog, reader: str) -> list[tuple[float, float]]:
    """When `reader` could not read, through no fault of plait's: the transport
    down for replication readers; a Spark query restarting (the fault stops it), or
    started again after failing in a PostgreSQL fault, until its first batch.
    (PostgreSQL's own down time is left out of every reader's stalls apart.)"""
    if reader in REPLICATION_READERS:
        return faults.outages
    if reader != SPARK:
        return []
    # A restart (the fault) and a revival (a query failed in a PostgreSQL fault and
    # started again, `spark_reader`) may overlap on one stream: paired apart.
    ends = {"restarted": "restarting", "revived": "reviving"}
    down, began = [], {}
    for line in journal.read(plan.journal(reader)):
        if line.kind != Kind.STATE:
            continue
        what = line.fields[0]
        if what in ends.values():
            began[what, line.fields[1]] = line.t
        elif what in ends and (ends[what], line.fields[1]) in began:
            down.append((began.pop((ends[what], line.fields[1])), line.t))
    return down


def _faults_around(plan: Plan, t0: float, span: tuple[float, float]) -> str:
    """What the schedule did from a few seconds before a stall to its end, with
    times from the schedule's start: where to look first in a failed run."""
    start, end = span
    faults = [
        f"{' '.join(line.fields)} at {line.t - t0:.1f} s"
        for line in journal.read(plan.run_dir / "faults.journal")
        if start - STALL_CONTEXT <= line.t <= end
    ]
    return (
        f"the stall lasted from {start - t0:.1f} s to {end - t0:.1f} s into the schedule;"
        f" faults from {STALL_CONTEXT:g} s before: {', '.join(faults) or 'none'}"
    )


def _reader_log(path: Path) -> ReaderLog:
    log = ReaderLog()
    for line in journal.read(path):
        if line.kind == Kind.DELIVERED:
            stream, writer, ids = line.fields
            log.rows.setdefault((stream, writer), []).extend(journal.id_list(ids))
        elif line.kind == Kind.TOKEN:
            stream, writer, token = line.fields
            log.tokens.setdefault((stream, writer), []).append((line.t, int(token)))
        elif line.kind == Kind.VIEW:
            stream, view = line.fields
            log.views.setdefault(stream, []).append((line.t, json.loads(view)))
        elif line.kind == Kind.VIOLATION:
            log.violations[line.fields[0]] += 1
        elif line.kind == Kind.STATE and line.fields[0] == "caught-up":
            log.caught_up = True
    return log
