"""The configuration of one plait instance: a pydantic model, from Python or YAML.

Every instance of a deployment shares the stream list and the replication settings;
`instance_name` is what differs. A bad value raises `ConfigError` naming the field and
what is allowed (R-OP-4), never a traceback from deep inside start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from plait.caches.invalidations import CACHES_STREAM
from plait.errors import ConfigError
from plait.streams.spec import StreamSpec, TableSpec

_NAME_PATTERN = r"^[^\s]+$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TableConfig(_Model):
    name: str
    id_column: str = "stream_id"
    instance_column: str = "instance_name"


class StreamConfig(_Model):
    """A stream: stored in PostgreSQL (`database`) or kept in its writers' memory
    (`memory`: typing notices and the like, replicated but never stored)."""

    name: str
    kind: Literal["database", "memory"] = "database"
    tables: list[TableConfig] = Field(default_factory=list)
    sequence: str = ""
    writers: list[str] = Field(default_factory=list)
    backwards: bool = False

    @model_validator(mode="after")
    def _check(self) -> StreamConfig:
        if self.kind == "database":
            self.to_spec()  # raises ConfigError on bad names
        elif not self.writers:
            raise ValueError(f"memory stream {self.name!r} needs its writers listed")
        elif self.tables or self.sequence or self.backwards:
            raise ValueError(f"memory stream {self.name!r} has no tables, sequence or direction")
        return self

    def to_spec(self) -> StreamSpec:
        return StreamSpec(
            name=self.name,
            tables=tuple(TableSpec(**t.model_dump()) for t in self.tables),
            sequence=self.sequence,
            writers=tuple(self.writers),
            backwards=self.backwards,
        )


class RedisConfig(_Model):
    url: str = "redis://127.0.0.1:6379/0"
    # One channel per deployment: "<channel_prefix>.<deployment>".
    channel_prefix: str = "plait"
    ping_interval: float = Field(30.0, gt=0)


class TcpConfig(_Model):
    hub: str = Field(pattern=_NAME_PATTERN)  # the instance that runs the hub
    host: str = "127.0.0.1"
    port: int = Field(9093, ge=0, le=65535)
    ping_interval: float = Field(5.0, gt=0)
    dead_after: float = Field(25.0, gt=0)
    send_queue: int = Field(10_000, ge=1)


class ReplicationConfig(_Model):
    transport: Literal["none", "redis", "tcp"] = "none"
    redis: RedisConfig = Field(default_factory=RedisConfig)
    tcp: TcpConfig | None = None
    announce_interval: float = Field(1.0, gt=0)
    # Rows per catch-up query: the first page, doubling after each full one up to the max.
    catch_up_page: int = Field(100, ge=1, le=10_000)
    catch_up_page_max: int = Field(10_000, ge=1, le=10_000)
    backoff_initial: float = Field(0.1, gt=0)
    backoff_cap: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> ReplicationConfig:
        if self.transport == "tcp" and self.tcp is None:
            raise ValueError("transport 'tcp' needs a tcp section naming the hub instance")
        if self.catch_up_page > self.catch_up_page_max:
            raise ValueError("catch_up_page must not exceed catch_up_page_max")
        if self.backoff_initial > self.backoff_cap:
            raise ValueError("backoff_initial must not exceed backoff_cap")
        return self


class HttpConfig(_Model):
    """The internal HTTP API: catch-up of in-memory streams, request endpoints, metrics."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0: any free port
    secret: SecretStr | None = None


class CachesConfig(_Model):
    """The `caches` stream and its cleanup (SPEC §7)."""

    enabled: bool = True
    # Invalidation rows older than this are deleted (seconds; default 7 days).
    retention: float = Field(7 * 24 * 3600.0, gt=0)
    cleanup: bool = True  # run the cleanup job on this instance
    cleanup_batch: int = Field(1000, ge=1, le=100_000)
    cleanup_interval: float = Field(3600.0, gt=0)  # between runs when there is no backlog
    cleanup_pause: float = Field(0.1, ge=0)  # between batches while there is one


class InstanceConfig(_Model):
    instance_name: str = Field(pattern=_NAME_PATTERN)
    deployment: str = Field("plait", pattern=_NAME_PATTERN)
    # PostgreSQL DSN; None starts (or reuses) the embedded server.
    database: str | None = None
    streams: list[StreamConfig] = Field(default_factory=list)
    # Base URL of each instance's internal HTTP API, e.g. {"worker1": "http://127.0.0.1:8081"}.
    instance_map: dict[str, str] = Field(default_factory=dict)
    replication: ReplicationConfig = Field(default_factory=ReplicationConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    caches: CachesConfig = Field(default_factory=CachesConfig)
    position_flush_interval: float = Field(1.0, gt=0)
    # Seconds a writer may hold a stream's linear position without moving before this
    # instance tries to fence it (which only succeeds when none of its connections is
    # alive); null: never fence.
    fence_after: float | None = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> InstanceConfig:
        names = [s.name for s in self.streams]
        if len(set(names)) != len(names):
            raise ValueError("a stream is listed twice")
        if self.caches.enabled and CACHES_STREAM in names:
            raise ValueError(
                f"the stream name {CACHES_STREAM!r} belongs to plait's cache invalidation "
                "stream; rename your stream, or set caches.enabled to false"
            )
        return self

    @property
    def channel(self) -> str:
        return f"{self.replication.redis.channel_prefix}.{self.deployment}"

    @classmethod
    def load(cls, value: Any) -> InstanceConfig:
        """From a mapping (as parsed from YAML or JSON); `ConfigError` when invalid."""
        if isinstance(value, InstanceConfig):
            return value
        try:
            return cls.model_validate(value)
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}"
                for e in err.errors()
            )
            raise ConfigError(f"invalid plait configuration: {problems}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> InstanceConfig:
        """From a YAML file; `overrides` replace top-level keys (one file can serve every
        instance of a deployment: `instance_name=...`)."""
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError(f"cannot read configuration file {path}: {err}") from None
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"configuration file {path} is not valid YAML: {err}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"configuration file {path} must hold a mapping at the top")
        return cls.load({**value, **overrides})
