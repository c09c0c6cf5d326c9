"""When the checker breaks what: a schedule (pure), and the record of what was done."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from plait.check.allowed import merged_windows
from plait.check.journal import Journal, Kind
from plait.check.plan import FAULT_KINDS, PG_OUTAGES, PG_PARTITION, Transport


def kinds_for(
    transport: Transport, *, spark: bool = False, postgres: bool = False
) -> tuple[str, ...]:
    """Every fault kind but a Redis restart, which needs Redis, a Spark query restart,
    which needs the Spark reader, and PostgreSQL restarts and crashes, which need a
    server the checker may restart (`postgres`). A partition touches one writer's
    connections only: it needs no server of the checker's own."""
    return tuple(
        k
        for k in FAULT_KINDS
        if (transport == "redis" or k != "redis_restart")
        and (spark or k != "spark_restart")
        and (postgres or k not in PG_OUTAGES)
    )


LONG_KINDS = ("spark_restart", *PG_OUTAGES, PG_PARTITION)  # each lasts seconds


def counts_for(
    kinds: tuple[str, ...], per_kind: int, long_per_kind: int | None = None
) -> dict[str, int]:
    """How many faults of each kind: `per_kind`, but fewer of the kinds that last
    seconds (`LONG_KINDS`), unless `long_per_kind` says how many: a quarter as many
    Spark query restarts (at least one), since more would leave the query restarting
    more than reading; and a tenth as many PostgreSQL restarts, crashes and partitions
    (at least one each), since each stops every process for one to three seconds, or
    one writer for longer than the keepalive bound."""

    def count(kind: str) -> int:
        if kind not in LONG_KINDS:
            return per_kind
        if long_per_kind is not None:
            return long_per_kind
        return max(1, per_kind // 4 if kind == "spark_restart" else per_kind // 10)

    return {k: count(k) for k in kinds}


def schedule(
    counts: dict[str, int],
    duration: float,
    rng: random.Random,
    lasting: dict[str, float] | None = None,
) -> list[tuple[float, str]]:
    """`counts[kind]` faults of each kind at random times in the run, leaving its first
    and last second alone (start-up, and the drain that follows). A kind that lasts
    (`lasting[kind]` seconds at most: a partition) begins early enough to end in the
    run, when the run is long enough: the drain does not wait for it."""
    low, high = min(1.0, duration / 4), max(duration - 1.0, duration * 3 / 4)
    lasts = lasting or {}
    times = [
        (rng.uniform(low, max(low, high - lasts.get(kind, 0.0))), kind)
        for kind, n in counts.items()
        for _ in range(n)
    ]
    return sorted(times)


@dataclass
class Partition:
    """One `pg_partition` of one writer: when its database proxy began holding every
    byte (`hole`), when it dropped the connections it held, as both ends' keepalives
    would have by then (`cut`, None if healed before), and when it forwarded again
    (`healed`, None while it lasts)."""

    hole: float
    cut: float | None = None
    healed: float | None = None


@dataclass
class FaultLog:
    """What was done, when: the verdict needs the deaths and the pauses; the journal
    (`F t kind target`) is for whoever reads a failed run."""

    journal: Journal | None = None
    counts: Counter[str] = field(default_factory=Counter)
    deaths: dict[str, list[float]] = field(default_factory=dict)
    stops: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # Partitions per writer: (black hole, connections dropped, healed); see `Partition`.
    partitions: dict[str, list[Partition]] = field(default_factory=dict)
    outages: list[tuple[float, float]] = field(default_factory=list)  # transport down
    db_outages: list[tuple[float, float]] = field(default_factory=list)  # PostgreSQL down
    # Faults that could not be injected when asked (each retried later), and why.
    failed: Counter[str] = field(default_factory=Counter)
    last_failure: dict[str, str] = field(default_factory=dict)
    fenced_alive: int = 0  # writers that learned they were fenced, and exited
    restarts: int = 0
    crashes: list[str] = field(default_factory=list)
    # Spark queries that failed in a PostgreSQL fault and were started again: why.
    revived: list[str] = field(default_factory=list)

    def injected(self, kind: str, target: str) -> None:
        self.counts[kind] += 1
        self.note(kind, target)

    def could_not_inject(self, kind: str, error: BaseException) -> None:
        """A fault the checker could not inject (PostgreSQL refused the connection the
        fault needed, say): counted, never the run's end; the schedule tries again."""
        self.failed[kind] += 1
        reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        self.last_failure[kind] = reason
        self.note("could-not-inject", f"{kind} {reason}")

    def note(self, what: str, target: str) -> None:
        if self.journal is not None:
            self.journal.write(Kind.FAULT, what, target)

    def death(self, writer: str, at: float) -> None:
        self.deaths.setdefault(writer, []).append(at)
        self.note("death", writer)

    def transport_down(self) -> float:
        """Seconds the transport was down (Redis restarts; overlaps counted once)."""
        return sum(end - start for start, end in merged_windows(self.outages))

    def db_down(self) -> float:
        """Seconds PostgreSQL was down (restarts and crashes)."""
        return sum(end - start for start, end in merged_windows(self.db_outages))

    def db_outage(self, start: float, end: float) -> None:
        self.db_outages.append((start, end))
        self.note("pg-up", f"{start:.4f}")

    def outage(self, start: float, end: float) -> None:
        self.outages.append((start, end))
        self.note("up", f"{start:.4f}")

    def partitioned(self, writer: str, at: float) -> Partition:
        partition = Partition(at)
        self.partitions.setdefault(writer, []).append(partition)
        return partition

    def partitioned_now(self, writer: str) -> bool:
        """Whether `writer`'s database proxy holds its bytes at this moment."""
        return any(p.healed is None for p in self.partitions.get(writer, []))

    def partitioned_windows(self, writer: str) -> list[list[float | None]]:
        """[start, end or None] of each partition of `writer` (`plan.fault_near`)."""
        return [[p.hole, p.healed] for p in self.partitions.get(writer, [])]

    def stop(self, writer: str, start: float, end: float) -> None:
        self.stops.setdefault(writer, []).append((start, end))
        self.note("cont", f"{writer} {start:.4f}")
