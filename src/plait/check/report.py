"""What a checker run found (`Report`): its counts, each reader's verdict and the problems
that make it fail, as `plait check` prints them and as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.check.faults import FaultLog
from plait.check.options import Options
from plait.check.verdict import (
    ReaderVerdict,
)


@dataclass
class Report:
    options: Options
    seed: int
    run_dir: Path
    elapsed: float
    committed: int
    rolled_back: int
    failed: int
    faults: FaultLog
    readers: list[ReaderVerdict]
    own_regressions: list[str]
    # What fails the run whatever the stall bounds; stalls are judged from `readers`.
    findings: list[str] = field(default_factory=list)
    # Per reader, when its longest stall was and which faults came shortly before it.
    stall_context: dict[str, str] = field(default_factory=dict)
    run_dir_kept: bool = True  # False: all held, and the folder plait made is gone
    # Writers that found themselves fenced when a partition healed and went on as a new
    # incarnation (the others exited with FENCED_EXIT: `faults.fenced_alive`).
    renewed: int = 0
    keepalive_bound: float = 0.0  # when a partition drops the connections it holds

    @property
    def problems(self) -> list[str]:
        """What fails the run: `findings`, and every stall past its bound."""
        return self.problems_at(1.0)

    def problems_at(self, stretch: float) -> list[str]:
        """The problems with every stall bound stretched by `stretch` (a machine that
        gave the run less CPU than it has: `tests/pace.py`'s `Contention`)."""
        stalls: list[str] = []
        for v in self.readers:
            stall = v.stall(self.options.bound(v.name) * stretch)
            if stall is not None:
                stalls.append(f"{v.name}: {stall}")
                if v.name in self.stall_context:
                    stalls.append(f"{v.name}: {self.stall_context[v.name]}")
        return [*self.findings, *stalls]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "seed": self.seed,
            "transport": self.options.transport,
            "duration": self.options.duration,
            "elapsed": round(self.elapsed, 1),
            "rows": self.committed,
            "rolled_back": self.rolled_back,
            "failed": self.failed,
            "faults": dict(self.faults.counts),
            "fenced_alive": self.faults.fenced_alive,
            "renewed": self.renewed,
            "partitions": sum(len(p) for p in self.faults.partitions.values()),
            "restarts": self.faults.restarts,
            "crashes": self.faults.crashes,
            "transport_down": round(self.faults.transport_down(), 1),
            "postgres_down": round(self.faults.db_down(), 1),
            "could_not_inject": dict(self.faults.failed),
            "spark_queries_revived": len(self.faults.revived),
            "stall_bound": self.options.stall_bound,
            "spark_stall_bound": self.options.spark_stall_bound if self.options.spark else None,
            "readers": {
                r.name: {
                    "delivered": r.delivered,
                    "lost": r.lost,
                    "duplicated": r.duplicated,
                    "phantom": r.phantom,
                    "regressions": r.regressions,
                    "stale": r.stale,
                    "replays": r.replays,
                    "longest_stall": round(r.longest_stall, 3),
                    "stall_at": r.stall_at,
                    "held_by": r.held_by or None,
                    "caught_up": r.caught_up,
                    "died": r.died or None,
                }
                for r in self.readers
            },
            "problems": self.problems,
            "run_dir": str(self.run_dir),
        }
