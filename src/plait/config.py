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
from plait.core.inbound import DEFAULT_INBOUND_QUEUE
from plait.errors import ConfigError
from plait.replication.redis_options import CertReqs, RedisTls, check_signing, client_options
from plait.storage.database import DEFAULT_RETRY_READS_FOR
from plait.storage.timeouts import DatabaseTimeouts
from plait.streams.spec import StreamSpec, TableSpec

_NAME_PATTERN = r"^[^\s]+$"
# Largest configuration file read; real ones are a few kilobytes.
MAX_CONFIG_BYTES = 1 << 20
# Bounds on a loaded configuration (see `_check_size`), and on the problems one error lists.
_MAX_VALUES = 100_000
_MAX_DEPTH = 32
_MAX_PROBLEMS = 20
_TLS_SETTINGS = (
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
)


class _Model(BaseModel):
    # No .inf or .nan (YAML floats): every interval and bound is a real number of seconds.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


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
    """Where the Redis of the deployment is. `rediss://` URLs speak TLS; the `ssl_*`
    settings (redis-py's names) apply to them only. The password may sit in the URL or,
    to keep it out of a URL, in `password`; it is never logged."""

    url: str = "redis://127.0.0.1:6379/0"
    password: SecretStr | None = None
    # One channel per deployment: "<channel_prefix>.<deployment>".
    channel_prefix: str = "plait"
    ping_interval: float = Field(30.0, gt=0)
    # With replication.secret: how far (seconds) a message's stamp may be from this
    # machine's clock, checked for the first message of each sender's connection (a
    # replay of an older one is refused). Clocks must agree within this (NTP).
    max_clock_skew: float = Field(60.0, gt=0)
    # PEM file of the CA(s) that signed the server's certificate; unset: the system's CAs.
    ssl_ca_certs: str | None = None
    # A client certificate (PEM), for a server that asks for one (tls-auth-clients), and
    # its unencrypted private key unless the certificate file holds it too.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # Verify the server's certificate: required (unset) or none (optional: as required,
    # for a client; accepted as redis-py accepts it).
    ssl_cert_reqs: CertReqs | None = None
    # Verify the server's host name against its certificate; unset: unless ssl_cert_reqs
    # is none.
    ssl_check_hostname: bool | None = None

    def check(self) -> None:
        """ConfigError (a ValueError, so reported like any other bad value): a missing
        certificate file, TLS settings on a redis:// URL, a password given twice.
        Checked only where Redis is the transport: a deployment on the TCP hub may keep
        a redis section whose files this machine does not have."""
        client_options(self.url, tls=self.tls(), password=self.password_value())

    def tls(self) -> RedisTls | None:
        """The TLS settings, or None when none of them is set (rediss:// URLs then verify
        the server against the system's CAs)."""
        if all(getattr(self, name) is None for name in _TLS_SETTINGS):
            return None
        return RedisTls(
            ca_certs=self.ssl_ca_certs,
            certfile=self.ssl_certfile,
            keyfile=self.ssl_keyfile,
            cert_reqs=self.ssl_cert_reqs or "required",
            check_hostname=self.ssl_check_hostname,
        )

    def password_value(self) -> str | None:
        return None if self.password is None else self.password.get_secret_value()


class TcpConfig(_Model):
    hub: str = Field(pattern=_NAME_PATTERN)  # the instance that runs the hub
    host: str = "127.0.0.1"
    port: int = Field(9093, ge=0, le=65535)
    ping_interval: float = Field(5.0, gt=0)
    dead_after: float = Field(25.0, gt=0)
    send_queue: int = Field(10_000, ge=1)
    # The hub closes a connection that has not finished the handshake (NAME, and with
    # replication.secret the proof) within this many seconds.
    handshake_timeout: float = Field(3.0, gt=0)


class ReplicationConfig(_Model):
    transport: Literal["none", "redis", "tcp"] = "none"
    redis: RedisConfig = Field(default_factory=RedisConfig)
    tcp: TcpConfig | None = None
    announce_interval: float = Field(1.0, gt=0)
    # Rows per catch-up query: the first page, doubling after each full one up to the max.
    catch_up_page: int = Field(100, ge=1, le=10_000)
    catch_up_page_max: int = Field(10_000, ge=1, le=10_000)
    # Commands a stream may have waiting per connection; past it they are dropped and
    # the stream catches up from the database instead (R-RP-9).
    inbound_queue: int = Field(DEFAULT_INBOUND_QUEUE, ge=1, le=10_000_000)
    backoff_initial: float = Field(0.1, gt=0)
    backoff_cap: float = Field(30.0, gt=0)
    # The deployment's replication secret: peers prove they hold it before anything but
    # the handshake is accepted (TCP), and every published line is signed with it (Redis).
    secret: SecretStr | None = None

    @model_validator(mode="after")
    def _check(self) -> ReplicationConfig:
        if self.transport == "tcp" and self.tcp is None:
            raise ValueError("transport 'tcp' needs a tcp section naming the hub instance")
        if self.transport == "redis":
            self.redis.check()
            check_signing(self.redis.url, self.secret_value())
        if self.catch_up_page > self.catch_up_page_max:
            raise ValueError("catch_up_page must not exceed catch_up_page_max")
        if self.backoff_initial > self.backoff_cap:
            raise ValueError("backoff_initial must not exceed backoff_cap")
        return self

    def secret_value(self) -> str | None:
        return None if self.secret is None else self.secret.get_secret_value()


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
    # How long a silent peer keeps a database connection, on both ends (TCP keepalives,
    # tcp_user_timeout, idle_in_transaction_session_timeout): a partitioned writer is
    # fenced only once its server processes end. What the DSN sets itself wins.
    database_timeouts: DatabaseTimeouts = Field(default_factory=DatabaseTimeouts)
    # Seconds plait waits for a PostgreSQL it cannot reach (not up yet, restarting,
    # crashed) before it fails with DatabaseUnavailableError: at start-up, and in its
    # own reads. What it waits for is logged meanwhile.
    database_patience: float = Field(DEFAULT_RETRY_READS_FOR, ge=0)
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
        _check_size(value)
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
            raise ConfigError(f"invalid plait configuration: {problems}") from None

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
        return cls.load({**value, **overrides})


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


def _check_size(value: Any) -> None:
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
                f"invalid plait configuration: it {what}; check for YAML aliases (*name) "
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
