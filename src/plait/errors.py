"""plait's exception types: each says what was wrong and what to do about it.

Callers catch what they mean: `ConfigError` for a bad spec, `StateError` for a call in
the wrong state (after close, before start), `TokenParseError` for a malformed token,
`DatabaseUnavailableError` when PostgreSQL cannot be reached, and so on.
All derive from `PlaitError`.
"""

from __future__ import annotations

from psycopg_pool import PoolTimeout


class PlaitError(Exception):
    """Base class of every error plait raises on purpose."""


class ConfigError(PlaitError, ValueError):
    """A stream spec, option or argument is invalid."""


class StateError(PlaitError, RuntimeError):
    """A call that the object's state does not allow: before `start()`, after
    `close()`, a second `start()`. The calling code is wrong, not the configuration."""


class DatabaseUnavailableError(PlaitError):
    """PostgreSQL could not be reached or is unsuitable (wrong DSN, too old, ...).

    When no server answered (or one refused the connection), `server` says where it was
    looked for (host:port/database, no secrets), `reason` what failed, and `waited` how
    many seconds plait waited for it, if it did: the command line words its own advice
    from them."""

    def __init__(
        self,
        message: str,
        *,
        server: str | None = None,
        reason: str | None = None,
        waited: float | None = None,
    ) -> None:
        super().__init__(message)
        self.server = server
        self.reason = reason
        self.waited = waited


class InvalidDsnError(DatabaseUnavailableError, ConfigError):
    """The DSN itself is malformed (libpq cannot parse it), so no server was tried: a
    configuration mistake, also a `DatabaseUnavailableError` for callers that catch
    every way of not reaching the database."""


class NoConnectionError(DatabaseUnavailableError, PoolTimeout):
    """No connection of the pool within its timeout: the server did not answer, or
    every connection stayed busy. Also a `psycopg_pool.PoolTimeout`, which is what
    callers caught before plait had its own type."""


class EmbeddedServerError(PlaitError):
    """The embedded PostgreSQL server could not be initialised, started or stopped."""


class SchemaError(PlaitError):
    """A stream's table, column or sequence is missing or has the wrong shape."""


class SequenceBehindError(PlaitError):
    """The stream's sequence is behind what plait has recorded; starting would reuse IDs."""


class PositionAboveHeadError(PlaitError):
    """A position names an ID the stream's sequence has not handed out: it was forged,
    corrupted, or comes from another database. It is refused, never stored."""


class NotAWriterError(PlaitError):
    """This instance tried to allocate stream IDs on a stream it is not configured to write."""


class TokenParseError(PlaitError, ValueError):
    """A stream token (text or JSON form) is malformed."""


class CommandParseError(PlaitError, ValueError):
    """A replication command line is malformed (or names a command nobody registered)."""


class RemoteCallError(PlaitError):
    """A call to another instance's internal HTTP API failed (refused, timed out after
    its retries, or answered with an error).

    `status` is the HTTP status of the last answer, when there was one (401: the
    instances' secrets differ; 404: no such stream or cache there; 503 after the
    retries: the instance was starting or stopping), else None (no answer at all)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class CacheKeyError(PlaitError, TypeError):
    """A cache key cannot be used: unhashable, or not a value that survives the trip to
    other instances as JSON (so it could never be invalidated there)."""


class FencedError(PlaitError):
    """This writer incarnation was fenced: another instance found none of its database
    connections alive and moved its positions past its IDs. It must not write again;
    restart the process (a new incarnation registers itself and goes on)."""


class SupersededError(FencedError):
    """A later run of this instance registered itself while this one still ran (it had
    lost its connections, and connected again): two processes must never write under
    one name. This run must not write again; stop it (the later one goes on)."""


class InstanceRunningError(PlaitError):
    """A writer cannot start: its instance's previous run still has connections to
    PostgreSQL (a process of that name still runs), so IDs it holds may still commit."""
