"""The chat service's tables and streams, and one configuration per process.

Processes (instance names):
- `main`: the TCP hub (or a Redis client), writer of `account_data`, `typing`
  (in memory), `backfill` (older history, negative IDs) and presence;
- `ev1`, `ev2`, ...: event writers; each owns the rooms `sharding.owner` gives it;
- `sync1`, ...: sync workers (`GET /sync`), no streams of their own;
- `bg`: the background worker that keeps `room_memberships` from `events`.

Every process lists every stream: readers follow them all, writers also write theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.config import InstanceConfig

MAIN = "main"

TABLES = """
CREATE TABLE IF NOT EXISTS events (
    stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,
    room_id TEXT NOT NULL, sender TEXT NOT NULL, body TEXT NOT NULL,
    at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS events_writer ON events (instance_name, stream_id);
CREATE INDEX IF NOT EXISTS events_id ON events (stream_id);
CREATE INDEX IF NOT EXISTS events_room ON events (room_id, stream_id);

-- Membership changes: the second table of the `events` stream.
CREATE TABLE IF NOT EXISTS room_state (
    stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,
    room_id TEXT NOT NULL, user_id TEXT NOT NULL, membership TEXT NOT NULL,
    at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS room_state_writer ON room_state (instance_name, stream_id);
CREATE INDEX IF NOT EXISTS room_state_id ON room_state (stream_id);

-- The current state, kept by the event writers in the same transaction as the change.
CREATE TABLE IF NOT EXISTS current_members (
    room_id TEXT NOT NULL, user_id TEXT NOT NULL, membership TEXT NOT NULL,
    PRIMARY KEY (room_id, user_id)
);

-- Older history imported backwards: IDs -1, -2, ... (the `backfill` stream).
CREATE TABLE IF NOT EXISTS backfill_events (
    stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,
    room_id TEXT NOT NULL, sender TEXT NOT NULL, body TEXT NOT NULL,
    at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS backfill_writer ON backfill_events (instance_name, stream_id);
CREATE INDEX IF NOT EXISTS backfill_id ON backfill_events (stream_id);

-- `account_data`: three tables, one stream, updates merged in stream-ID order.
CREATE TABLE IF NOT EXISTS global_account_data (
    stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,
    user_id TEXT NOT NULL, kind TEXT NOT NULL, content JSONB NOT NULL
);
CREATE TABLE IF NOT EXISTS room_account_data (
    stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,
    user_id TEXT NOT NULL, room_id TEXT NOT NULL, kind TEXT NOT NULL, content JSONB NOT NULL
);
CREATE TABLE IF NOT EXISTS room_tags (
    stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,
    user_id TEXT NOT NULL, room_id TEXT NOT NULL, tag TEXT NOT NULL, content JSONB NOT NULL
);
CREATE INDEX IF NOT EXISTS global_account_data_writer
    ON global_account_data (instance_name, stream_id);
CREATE INDEX IF NOT EXISTS room_account_data_writer
    ON room_account_data (instance_name, stream_id);
CREATE INDEX IF NOT EXISTS room_tags_writer ON room_tags (instance_name, stream_id);

-- The background worker's own view, from `events` alone (not from current_members),
-- and how far it got (written in the same transaction: exactly once across restarts).
CREATE TABLE IF NOT EXISTS room_memberships (
    user_id TEXT NOT NULL, room_id TEXT NOT NULL, membership TEXT NOT NULL,
    stream_id BIGINT NOT NULL, PRIMARY KEY (user_id, room_id)
);
CREATE TABLE IF NOT EXISTS worker_progress (
    worker TEXT PRIMARY KEY, stream_id BIGINT NOT NULL
);
"""


def streams(event_writers: Sequence[str]) -> list[dict[str, Any]]:
    return [
        {
            "name": "events",
            "tables": [{"name": "events"}, {"name": "room_state"}],
            "sequence": "events_seq",
            "writers": list(event_writers),
        },
        {
            "name": "backfill",
            "tables": [{"name": "backfill_events"}],
            "sequence": "backfill_seq",
            "writers": [MAIN],
            "backwards": True,
        },
        {
            "name": "account_data",
            "tables": [
                {"name": "global_account_data"},
                {"name": "room_account_data"},
                {"name": "room_tags"},
            ],
            "sequence": "account_data_seq",
            "writers": [MAIN],
        },
        {"name": "typing", "kind": "memory", "writers": [MAIN]},
    ]


def config_dict(
    name: str,
    *,
    database: str,
    event_writers: Sequence[str],
    http_ports: dict[str, int],
    secret: str,
    redis: str | None = None,
    hub_port: int = 0,
) -> dict[str, Any]:
    """The configuration of process `name` of a deployment, as plain data (what a YAML
    file for `plait serve` holds): the same for all of them but for the name (every
    process knows every other's HTTP address)."""
    replication: dict[str, Any] = (
        {"transport": "redis", "redis": {"url": redis}}
        if redis
        else {"transport": "tcp", "tcp": {"hub": MAIN, "port": hub_port}}
    )
    return {
        "instance_name": name,
        "deployment": "plait-demo",
        "database": database,
        "streams": streams(event_writers),
        "instance_map": {n: f"http://127.0.0.1:{p}" for n, p in http_ports.items()},
        "http": {"port": http_ports[name], "secret": secret},
        "replication": {**replication, "announce_interval": 0.5, "secret": secret},
        "position_flush_interval": 0.5,
    }


def config(name: str, **options: Any) -> InstanceConfig:
    """`config_dict`, validated."""
    return InstanceConfig.load(config_dict(name, **options))
