"""plait: multi-writer, ordered streams on PostgreSQL.

Several writer processes append to the same streams with IDs from one shared sequence,
committing out of order; plait tracks what each writer has finished and turns it into
safe positions and vector-clock tokens that readers follow without skipping or
repeating a row.
"""

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from plait.core.positions import PositionTracker
from plait.core.spec import StreamSpec, TableSpec
from plait.core.tokens import StreamToken
from plait.errors import (
    CacheKeyError,
    CommandParseError,
    ConfigError,
    DatabaseUnavailableError,
    EmbeddedServerError,
    FencedError,
    InstanceRunningError,
    InvalidDsnError,
    NoConnectionError,
    NotAWriterError,
    PlaitError,
    PositionAboveHeadError,
    RemoteCallError,
    SchemaError,
    SequenceBehindError,
    StateError,
    SupersededError,
    TokenParseError,
)
from plait.storage.database import Database
from plait.storage.embedded import EmbeddedPostgres
from plait.storage.stream_tables import StreamRow
from plait.storage.transaction import Transaction
from plait.streams.batcher import Batcher
from plait.streams.generator import MultiWriterIdGenerator

if TYPE_CHECKING:
    from plait.instance import Instance

# A library's logs are its application's to show: without a handler of the application's
# own, Python's last-resort handler would print plait's warnings to stderr.
logging.getLogger("plait").addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    """`plait.Instance`, imported when first asked for: it brings the replication,
    HTTP and cache layers, which a user of the generator alone does not need."""
    if name == "Instance":
        from plait.instance import Instance

        return Instance
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


try:
    __version__ = version("plait")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "Batcher",
    "CacheKeyError",
    "CommandParseError",
    "ConfigError",
    "Database",
    "DatabaseUnavailableError",
    "EmbeddedPostgres",
    "EmbeddedServerError",
    "FencedError",
    "Instance",
    "InstanceRunningError",
    "InvalidDsnError",
    "MultiWriterIdGenerator",
    "NoConnectionError",
    "NotAWriterError",
    "PlaitError",
    "PositionAboveHeadError",
    "PositionTracker",
    "RemoteCallError",
    "SchemaError",
    "SequenceBehindError",
    "StateError",
    "StreamRow",
    "StreamSpec",
    "StreamToken",
    "SupersededError",
    "TableSpec",
    "TokenParseError",
    "Transaction",
]
