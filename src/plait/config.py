"""The configuration of one plait instance: a pydantic model, from Python or YAML.

Every instance of a deployment shares the stream list and the replication settings;
`instance_name` is what differs. A bad value raises `ConfigError` naming the field and
what is allowed (R-OP-4), never a traceback from deep inside start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, SecretStr, ValidationError, model_validator

from plait.caches.invalidations import CACHES_STREAM
from plait.core.spec import StreamSpec, TableSpec
from plait.errors import ConfigError
from plait.options import Options, revealed
from plait.ports import is_loopback
from plait.replication.handler_options import HandlerOptions
from plait.replication.redis_options import RedisOptions, check_signing
from plait.replication.tcp_options import TcpOptions
from plait.storage.database import DEFAULT_RETRY_READS_FOR
from plait.storage.timeouts import DatabaseTimeouts

_NAME_PATTERN = r"^[^\s]+$"
# Largest configuration file read; real ones are a few kilobytes.
MAX_CONFIG_BYTES = 1 << 20
# Bounds on a loaded configuration (see `_check_size`), and on the problems one error lists.
_MAX_VALUES = 100_000
_MAX_DEPTH = 32
_MAX_PROBLEMS = 20


class TableConfig(Options):
    """One table a stream's rows live in."""

    name: str
    """The table's name (schema-qualified if need be)."""
    id_column: str = "stream_id"
    """The column holding each row's stream ID."""
    instance_column: str = "instance_name"
    """The column holding the name of the writer that wrote the row."""


class StreamConfig(Options):
    """A stream: stored in PostgreSQL (`database`) or kept in its writers' memory
    (`memory`: typing notices and the like, replicated but never stored)."""

    name: str
    """The stream's name."""
    kind: Literal["database", "memory"] = "database"
    """`database` (rows in tables) or `memory` (replicated, never stored)."""
    tables: list[TableConfig] = Field(default_factory=list)
    """The tables its rows live in (a database stream)."""
    sequence: str = ""
    """The PostgreSQL sequence its IDs come from; empty: `<name>_seq`."""
    writers: list[str] = Field(default_factory=list)
    """The instances that write it; empty: any instance may."""
    backwards: bool = False
    """IDs count down (-1, -2, ...), for history imported behind the stream's start."""

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


class RedisConfig(RedisOptions):
    """Where the Redis of the deployment is (`RedisOptions`), and its channel. The
    certificate files are checked only where Redis is the transport (`check`): a
    deployment on the TCP hub may keep a redis section whose files this machine does
    not have."""

    channel_prefix: str = "plait"
    """One pub/sub channel per deployment: `<channel_prefix>.<deployment>`."""


class TcpConfig(TcpOptions):
    """Replication over TCP on one host: one instance runs the hub, the others connect.
    The transport's own settings (address, pings, bounds) are `TcpOptions`'."""

    hub: str = Field(pattern=_NAME_PATTERN)
    """The instance that runs the hub (required)."""


class ReplicationConfig(HandlerOptions):
    """How instances hear of each other's rows: the handler's settings
    (`HandlerOptions`), the transport and its settings, the retries and the secret."""

    transport: Literal["none", "redis", "tcp"] = "none"
    """`none`, `redis` or `tcp`."""
    redis: RedisConfig = Field(default_factory=RedisConfig)
    """The Redis of the deployment (transport `redis`)."""
    tcp: TcpConfig | None = None
    """The TCP hub (transport `tcp`)."""
    backoff_initial: float = Field(0.1, gt=0)
    """The first wait (seconds) before a failed connection or catch-up is tried again."""
    backoff_cap: float = Field(30.0, gt=0)
    """The longest such wait."""
    secret: SecretStr | None = None
    """The deployment's replication secret: TCP peers prove they hold it before anything
    but the handshake is accepted, and every Redis message is signed with it. Required
    for a hub off loopback and a Redis off this machine."""

    @model_validator(mode="after")
    def _check(self) -> ReplicationConfig:
        if self.transport == "tcp" and self.tcp is None:
            raise ValueError("transport 'tcp' needs a tcp section naming the hub instance")
        if self.transport == "redis":
            self.redis.check()
            check_signing(self.redis.url, self.secret_value())
        if self.backoff_initial > self.backoff_cap:
            raise ValueError("backoff_initial must not exceed backoff_cap")
        return self

    def secret_value(self) -> str | None:
        return revealed(self.secret)


class HttpConfig(Options):
    """The internal HTTP API: catch-up of in-memory streams, request endpoints, metrics."""

    enabled: bool = True
    """Serve it."""
    host: str = "127.0.0.1"
    """The address to listen on; anything but loopback needs `secret`."""
    port: int = Field(0, ge=0, le=65535)
    """The port; 0: any free port. An instance with an entry of its own in
    `instance_map` listens on that entry's port instead (what the others call)."""
    secret: SecretStr | None = None
    """The bearer secret callers must send (compared in constant time; 401 without it)."""

    def secret_value(self) -> str | None:
        return revealed(self.secret)


class CachesConfig(Options):
    """The `caches` stream and its cleanup (SPEC §7)."""

    enabled: bool = True
    """Keep the cache invalidation stream."""
    retention: float = Field(7 * 24 * 3600.0, gt=0)
    """Invalidation rows older than this many seconds are deleted (default 7 days)."""
    cleanup: bool = True
    """Run the cleanup job on this instance."""
    cleanup_batch: int = Field(1000, ge=1, le=100_000)
    """Rows deleted per cleanup statement."""
    cleanup_interval: float = Field(3600.0, gt=0)
    """Seconds between cleanup runs when there is no backlog."""
    cleanup_pause: float = Field(0.1, ge=0)
    """Seconds between batches while there is a backlog."""


class InstanceConfig(Options):
    """One process's configuration: the same file for every instance of a deployment,
    but for `instance_name`."""

    instance_name: str = Field(pattern=_NAME_PATTERN)
    """This process's name; writer names in streams refer to it (required)."""
    deployment: str = Field("plait", pattern=_NAME_PATTERN)
    """Redis channel suffix: deployments sharing a Redis stay apart."""
    database: str | None = None
    """PostgreSQL DSN; none starts (or reuses) the embedded server."""
    database_timeouts: DatabaseTimeouts = Field(default_factory=DatabaseTimeouts)
    """How long a silent peer keeps a database connection, on both ends (TCP keepalives,
    tcp_user_timeout, idle_in_transaction_session_timeout): a partitioned writer is
    fenced only once its server processes end. What the DSN sets itself wins."""
    database_patience: float = Field(DEFAULT_RETRY_READS_FOR, ge=0)
    """Seconds plait waits for a PostgreSQL it cannot reach (not up yet, restarting,
    crashed) before it fails with DatabaseUnavailableError: at start-up, and in its own
    reads. What it waits for is logged meanwhile."""
    streams: list[StreamConfig] = Field(default_factory=list)
    """The streams this deployment has."""
    instance_map: dict[str, str] = Field(default_factory=dict)
    """Base URL of each instance's internal HTTP API, e.g.
    `{"worker1": "http://127.0.0.1:8081"}`."""
    replication: ReplicationConfig = Field(default_factory=ReplicationConfig)
    """How instances hear of each other's rows."""
    http: HttpConfig = Field(default_factory=HttpConfig)
    """The internal HTTP API."""
    caches: CachesConfig = Field(default_factory=CachesConfig)
    """Caches that stay correct across instances."""
    position_flush_interval: float = Field(1.0, gt=0)
    """Seconds between refreshes of a writer's position row while it is idle."""
    fence_after: float | None = Field(1.0, gt=0)
    """Seconds a writer may hold a stream's linear position without moving before this
    instance tries to fence it (which only succeeds when none of its connections is
    alive); null: never fence."""

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

    def http_address(self) -> tuple[str, int, str]:
        """Where this instance's HTTP API listens, and the setting that says so: `http.host`
        and, when its own `instance_map` entry is on this machine (a loopback address:
        what the others call is this very socket), that entry's port (one file serves
        every instance, and a shared `http.port` is right for one of them only); else
        `http.port` (an entry elsewhere may be a port forwarded to this one, as in a
        container)."""
        own = self.instance_map.get(self.instance_name)
        if own:
            host, port = _address_of(own)
            if port is not None and host is not None and is_loopback(host):
                return self.http.host, port, f"instance_map.{self.instance_name}"
        return self.http.host, self.http.port, "http.port"

    def holders_of(self, port: int) -> list[str]:
        """The other instances `instance_map` gives `port` on this machine to."""
        addresses = {name: _address_of(url) for name, url in self.instance_map.items()}
        return sorted(
            name
            for name, (host, at) in addresses.items()
            if name != self.instance_name and at == port and is_loopback(host or "")
        )

    @classmethod
    def load(cls, value: Any, source: str = "plait configuration") -> InstanceConfig:
        """From a mapping (as parsed from YAML or JSON); `ConfigError` when invalid,
        naming `source` (the file it came from)."""
        if isinstance(value, InstanceConfig):
            return value
        _check_size(value, source)
        try:
            return cls.model_validate(value)
        except ValidationError as err:
            errors = err.errors()
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}"
                for e in errors[:_MAX_PROBLEMS]
            )
            if len(errors) > _MAX_PROBLEMS:
                problems += f"; and {len(errors) - _MAX_PROBLEMS} more problems"
            raise ConfigError(f"invalid {source}: {problems}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> InstanceConfig:
        """From a YAML file of at most `MAX_CONFIG_BYTES`; `overrides` replace top-level
        keys (one file can serve every instance of a deployment: `instance_name=...`)."""
        try:
            with Path(path).open("rb") as file:
                data = file.read(MAX_CONFIG_BYTES + 1)
        except OSError as err:
            raise ConfigError(f"cannot read configuration file {path}: {err}") from None
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"configuration file {path} is over {MAX_CONFIG_BYTES} bytes; "
                "a plait configuration is far smaller: is it the right file?"
            )
        try:
            # Bytes: PyYAML checks the encoding itself.
            value = yaml.load(data, Loader=_BoundedLoader)  # a SafeLoader
        except Exception as err:  # PyYAML's constructors raise anything (ValueError, ...)
            raise ConfigError(
                f"configuration file {path} is not valid YAML: {_yaml_problem(err)}"
            ) from None
        if not isinstance(value, dict):
            raise ConfigError(f"configuration file {path} must hold a mapping at the top")
        return cls.load({**value, **overrides}, f"configuration file {path}")


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing nesting deeper than `_MAX_DEPTH` as soon as it
    reads it: its scanner takes time quadratic in the depth of `[[[[...`, and its
    composer recurses once per level."""

    def __init__(self, stream: bytes) -> None:
        super().__init__(stream)
        self._depth = 0

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        if self.flow_level >= _MAX_DEPTH:
            raise yaml.scanner.ScannerError(
                None, None, f"nested more than {_MAX_DEPTH} levels deep", self.get_mark()
            )
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > _MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nested more than {_MAX_DEPTH} levels deep",
                    self.get_mark(),
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _address_of(url: str) -> tuple[str | None, int | None]:
    try:
        parts = urlsplit(url)
        return parts.hostname, parts.port
    except ValueError:  # a port that is no number, or out of range
        return None, None


def _check_size(value: Any, source: str) -> None:
    """`ConfigError` for a value nested deeper than `_MAX_DEPTH` or holding more than
    `_MAX_VALUES` values, counting shared ones once per place they appear.

    YAML aliases let a few kilobytes name millions of values (a "billion laughs"), or a
    value that holds itself; validating that would take minutes or never end. No real
    configuration comes near either bound."""
    seen = 0
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        seen += 1
        if seen > _MAX_VALUES or depth > _MAX_DEPTH:
            what = (
                f"is nested more than {_MAX_DEPTH} levels deep"
                if depth > _MAX_DEPTH
                else f"holds more than {_MAX_VALUES} values"
            )
            raise ConfigError(
                f"invalid {source}: it {what}; check for YAML aliases (*name) "
                "that repeat large parts or refer to themselves"
            )
        if isinstance(item, dict):
            pending.extend((v, depth + 1) for v in item.values())
            pending.extend((k, depth + 1) for k in item)
        elif isinstance(item, list | tuple | set | frozenset):
            pending.extend((v, depth + 1) for v in item)


def _yaml_problem(err: Exception) -> str:
    """What is wrong and where, without quoting the file: the offending line may hold
    a secret, and this message ends up in logs."""
    if isinstance(err, yaml.MarkedYAMLError):
        where = err.problem_mark or err.context_mark
        problem = err.problem or err.context or "malformed YAML"
        if where is None:
            return problem
        return f"{problem} (line {where.line + 1}, column {where.column + 1})"
    if isinstance(err, yaml.YAMLError):
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, RecursionError):
        return "nested too deeply"
    # A tagged or implicitly typed scalar PyYAML could not build (2020-13-45, !!int x):
    # its message quotes the value, which may be a secret.
    return f"a value could not be read ({type(err).__name__})"
