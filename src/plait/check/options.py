"""What a checker run is asked to do: the options of `plait check`, and their defaults
(the command's too). Light to import: the CLI reads it at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from plait.check.faults import counts_for, kinds_for
from plait.check.plan import FAULT_KINDS, READERS, SPARK, Transport
from plait.errors import ConfigError


@dataclass(frozen=True)
class Options:
    # None: the checker starts a PostgreSQL of its own (the embedded server), which it
    # may restart and crash. A server named here is never restarted.
    dsn: str | None = None
    transport: Transport = "tcp"
    writers: int = 3
    streams: int = 2
    duration: float = 30.0
    faults: int = 20  # of each kind
    # Of each kind that lasts seconds (`faults.LONG_KINDS`); None: derived from `faults`.
    long_faults: int | None = None
    batch: int = 1  # scales the IDs per transaction (1 to 13)
    seed: int | None = None
    fence_after: float = 1.0
    stall_bound: float = 4.0
    # A Spark query's micro-batches (planning, Python workers, a JVM on a machine the
    # writers keep busy) take about a second each, and several on a loaded machine: its
    # bound catches a position that stops, not Spark's own pace.
    spark_stall_bound: float = 15.0
    run_dir: Path | None = None
    keep: bool = False
    spark: bool = False  # a Spark streaming query per stream, as one more reader
    # PostgreSQL restarts and crashes (`pg_restart`, `pg_crash`). None: on when the
    # checker starts its own server (no `dsn`), off otherwise.
    pg_faults: bool | None = None
    # Only these fault kinds (`--kind`); None: every kind the run can have.
    kinds: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.dsn is not None and self.pg_faults:
            raise ConfigError(
                "PostgreSQL faults restart and kill -9 the server, and the checker restarts"
                " only a server it started itself: leave out the DSN to let it start its"
                " own, or leave out the PostgreSQL faults"
            )
        if self.kinds is not None:
            unknown = sorted(set(self.kinds) - set(FAULT_KINDS))
            if unknown:
                raise ConfigError(
                    f"unknown fault kind {', '.join(unknown)}: the kinds are"
                    f" {', '.join(FAULT_KINDS)}"
                )
            possible = self._possible_kinds()
            impossible = [k for k in self.kinds if k not in possible]
            if impossible:
                raise ConfigError(
                    f"this run cannot have {', '.join(impossible)}: redis_restart needs"
                    " --transport redis, spark_restart --spark, and pg_restart and pg_crash"
                    " a server of the checker's own (no DSN, PostgreSQL faults on)"
                )

    @property
    def postgres_faults(self) -> bool:
        return self.dsn is None if self.pg_faults is None else self.pg_faults

    @property
    def readers(self) -> tuple[str, ...]:
        return (*READERS, SPARK) if self.spark else READERS

    def _possible_kinds(self) -> tuple[str, ...]:
        return kinds_for(self.transport, spark=self.spark, postgres=self.postgres_faults)

    @property
    def fault_counts(self) -> dict[str, int]:
        kinds = self._possible_kinds()
        if self.kinds is not None:
            kinds = tuple(k for k in kinds if k in self.kinds)
        return counts_for(kinds, self.faults, self.long_faults)

    def bound(self, reader: str) -> float:
        return self.spark_stall_bound if reader == SPARK else self.stall_bound
