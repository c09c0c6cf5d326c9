"""What one checker run is made of, shared by the orchestrator and its processes.

The orchestrator builds a `Plan`, hands each process its part as JSON on the command
line, and reads their journals back from `run_dir`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from plait.errors import ConfigError
from plait.storage.timeouts import DatabaseTimeouts

Transport = Literal["tcp", "redis"]

# The readers, one process each: what they follow and how.
FOLLOWER = "follower"  # per-writer tokens over replication (and the TCP hub)
LINEAR = "linear"  # the linear position over replication, rows read from the database
DB_LINEAR = "dblinear"  # the linear position from the database alone, no transport
WORKER = "worker"  # a worker with caches, invalidated by the writers' transactions
SPARK = "spark"  # a Structured Streaming query per stream (optional: `--spark`)
READERS = (FOLLOWER, LINEAR, DB_LINEAR, WORKER)
REPLICATION_READERS = (FOLLOWER, LINEAR)  # stalled by a transport outage

KV_CACHE = "kv"  # the worker's cache of check_kv values
KV_CHANGED = "kv_changed"  # the pseudo-cache the writers invalidate it through
KV_KEYS = 64  # keys per stream

FAULT_KINDS = (
    "kill",
    "stop",
    "slow_commit",
    "pg_terminate",
    "transport_cut",
    "redis_restart",
    "spark_restart",
    "pg_restart",
    "pg_crash",
    "pg_partition",
)
PG_OUTAGES = ("pg_restart", "pg_crash")  # only against a server the checker started
# One writer's database connections black-holed (its fault proxy), longer than the
# keepalive bound: on any server, since only that writer's connections are touched.
PG_PARTITION = "pg_partition"


def keepalive_bound(timeouts: DatabaseTimeouts) -> float:
    """How long both ends of a database connection take to give up a silent peer, by
    the writers' `database_timeouts`: keepalives end an idle connection after
    `dead_after`, `tcp_user_timeout` one whose data goes unacknowledged. A partition
    (`pg_partition`) drops the connections it holds after this long, as the kernels
    would have: the proxy's own kernel answers both ends, so neither would notice."""
    bounds = [b for b in (timeouts.dead_after, timeouts.tcp_user_timeout) if b is not None]
    if not bounds:
        raise ConfigError(
            "pg_partition needs a bound on a silent database connection: keepalives or"
            " tcp_user_timeout in database_timeouts (without either a partitioned"
            " writer's idle connections live for hours and it is never fenced)"
        )
    return max(bounds)


@dataclass(frozen=True)
class Plan:
    dsn: str  # with the run's own schema on its search_path
    transport: Transport
    run_dir: Path
    writers: tuple[str, ...]
    streams: int
    fence_after: float
    redis_url: str = ""
    hub_port: int = 0  # where the hub listens (tcp)
    proxy_port: int = 0  # where everyone else connects: the fault proxy in front of it
    concurrency: int = 4  # transactions in flight per writer
    batch: int = 1  # IDs per transaction: 1 to 13, times this
    slow_commit: float = 10.0
    # Where each writer reaches PostgreSQL: its own fault proxy (`pg_partition`).
    db_ports: dict[str, int] = field(default_factory=dict)

    @property
    def stream_names(self) -> list[str]:
        return [f"s{i}" for i in range(self.streams)]

    def table(self, stream: str) -> str:
        return f"check_{stream}"

    def database(self, name: str) -> str:
        """The DSN process `name` connects with: a writer's goes through its fault
        proxy, every other process connects directly. A host name stays (TLS checks
        the server's certificate against it); the address is the proxy's."""
        port = self.db_ports.get(name)
        if port is None:
            return self.dsn
        params = conninfo_to_dict(self.dsn)
        host = str(params.get("host") or "")
        if host and not host.startswith("/") and "," not in host:
            params["hostaddr"] = "127.0.0.1"
        else:  # a Unix socket's directory, the default, or several hosts
            params.pop("hostaddr", None)
            params["host"] = "127.0.0.1"
        params["port"] = str(port)
        return make_conninfo("", **params)

    def journal(self, process: str) -> Path:
        return self.run_dir / f"{process}.journal"

    @property
    def slow_made(self) -> Path:
        """One line per slow commit a writer began (all writers, appended)."""
        return self.run_dir / "slow.made"

    @property
    def control(self) -> Path:
        return self.run_dir / "control.json"

    def instance_config(self, name: str) -> dict[str, Any]:
        """The `Instance` configuration of process `name`."""
        tcp = None
        if self.transport == "tcp":
            port = self.hub_port if name == FOLLOWER else self.proxy_port
            tcp = {"hub": FOLLOWER, "port": port, "ping_interval": 1.0, "dead_after": 5.0}
        return {
            "instance_name": name,
            "deployment": "check",
            "database": self.database(name),
            "streams": [
                {"name": s, "tables": [{"name": self.table(s)}], "writers": list(self.writers)}
                for s in self.stream_names
            ],
            "replication": {
                "transport": self.transport,
                # A PING each second: a connection whose PINGs stop coming back is
                # replaced within 3 s, not 90 (the default interval is 30 s).
                "redis": {
                    "url": self.redis_url or "redis://127.0.0.1:6379/0",
                    "ping_interval": 1.0,
                },
                "tcp": tcp,
                "announce_interval": 0.5,
                "backoff_initial": 0.05,
                "backoff_cap": 1.0,
            },
            "http": {"enabled": False},
            "caches": {"enabled": True, "cleanup": False},
            "position_flush_interval": 0.2,
            "fence_after": self.fence_after,
        }

    def to_json(self) -> str:
        value = asdict(self)
        value["run_dir"] = str(self.run_dir)
        value["writers"] = list(self.writers)
        return json.dumps(value)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        value = json.loads(text)
        value["run_dir"] = Path(value["run_dir"])
        value["writers"] = tuple(value["writers"])
        return cls(**value)


def write_control(path: Path, value: dict[str, Any]) -> None:
    """Replace the orders at once: a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


# How long after a PostgreSQL fault a failure is taken for its effect (a process that
# could not start, a Spark query that could not read): started again, not a crash.
# Spark's Python workers keep a connection broken by the fault and fail on it when next
# used, which on a busy machine was 11 s after the server came back.
PG_SETTLE = 20.0


def postgres_fault_near(control: dict[str, Any], now: float) -> bool:
    """Whether PostgreSQL is down now, or was less than `PG_SETTLE` seconds ago, by the
    orchestrator's orders (`pg_down`: [start, end or null] of each PostgreSQL fault)."""
    return fault_near(control.get("pg_down"), now)


def fault_near(windows: Any, now: float) -> bool:
    """Whether one of `windows` ([start, end or null] each) is open now, or ended less
    than `PG_SETTLE` seconds ago."""
    if not isinstance(windows, list):
        return False
    for window in windows:
        if not (isinstance(window, list) and len(window) == 2):
            continue
        end = window[1]
        if end is None or (isinstance(end, (int, float)) and now <= end + PG_SETTLE):
            return True
    return False


def read_control(path: Path) -> dict[str, Any]:
    """The orchestrator's orders (rewritten atomically); {} before the first."""
    try:
        value = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
