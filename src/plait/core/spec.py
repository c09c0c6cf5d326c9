"""What a stream is made of: its sequence, its tables and its writers."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from plait.errors import ConfigError

# A plain or schema-qualified SQL name; quoting is done by psycopg.sql, this only keeps
# typos (spaces, quotes, empty parts) from reaching the database as odd identifiers.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}")


def _check_name(value: object, what: str, *, qualified: bool = False) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what} must be a non-empty string, not {value!r}")
    parts = value.split(".") if qualified else [value]
    if len(parts) > 2 or not all(_NAME.fullmatch(p) for p in parts):
        form = "name or schema.name" if qualified else "name"
        raise ConfigError(
            f"{what} {value!r} is not a valid SQL {form} (letters, digits, _ and $; "
            "starting with a letter or _)"
        )
    return value


@dataclass(frozen=True)
class TableSpec:
    """A table holding rows of a stream: its ID column and its writer-name column."""

    name: str
    id_column: str = "stream_id"
    instance_column: str = "instance_name"

    def __post_init__(self) -> None:
        _check_name(self.name, "table name", qualified=True)
        _check_name(self.id_column, f"id column of table {self.name!r}")
        _check_name(self.instance_column, f"instance column of table {self.name!r}")
        if self.id_column == self.instance_column:
            raise ConfigError(f"table {self.name!r}: id and instance columns must differ")

    def to_json(self) -> dict[str, str]:
        return {
            "name": self.name,
            "id_column": self.id_column,
            "instance_column": self.instance_column,
        }


@dataclass(frozen=True)
class StreamSpec:
    """A stream: one sequence, one or more tables, and the instances allowed to write.

    An empty `writers` list means any instance may write ("any writer" mode: no rows in
    `stream_positions`). A `backwards` stream stores negative IDs (for backfill).
    """

    name: str
    tables: Sequence[TableSpec]
    sequence: str = ""
    writers: Sequence[str] = field(default_factory=tuple)
    backwards: bool = False

    def __post_init__(self) -> None:
        _check_name(self.name, "stream name")
        if not self.sequence:
            object.__setattr__(self, "sequence", f"{self.name}_seq")
        _check_name(self.sequence, f"sequence of stream {self.name!r}", qualified=True)
        if isinstance(self.tables, TableSpec):
            object.__setattr__(self, "tables", (self.tables,))
        tables = tuple(self.tables)
        if not tables:
            raise ConfigError(f"stream {self.name!r} needs at least one table")
        if not all(isinstance(t, TableSpec) for t in tables):
            raise ConfigError(f"stream {self.name!r}: tables must be TableSpec objects")
        if len({t.name for t in tables}) != len(tables):
            raise ConfigError(f"stream {self.name!r} lists a table twice")
        object.__setattr__(self, "tables", tables)
        if isinstance(self.writers, str):
            raise ConfigError(
                f"stream {self.name!r}: writers must be a list of names, not the string "
                f"{self.writers!r}"
            )
        writers = tuple(self.writers)
        for writer in writers:
            if not isinstance(writer, str) or not writer or writer != writer.strip():
                raise ConfigError(f"stream {self.name!r}: bad writer name {writer!r}")
        if len(set(writers)) != len(writers):
            raise ConfigError(f"stream {self.name!r} lists a writer twice")
        object.__setattr__(self, "writers", writers)
        if not isinstance(self.backwards, bool):
            raise ConfigError(f"stream {self.name!r}: backwards must be True or False")

    @property
    def any_writer(self) -> bool:
        return not self.writers

    @property
    def sign(self) -> int:
        """Stored ID = sign * internal ID."""
        return -1 if self.backwards else 1

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sequence": self.sequence,
            "writers": list(self.writers),
            "backwards": self.backwards,
            "tables": [t.to_json() for t in self.tables],
        }

    @classmethod
    def from_json(cls, value: object) -> StreamSpec:
        """The spec `to_json` gave (as stored in `plait_streams`); `ConfigError` saying
        what is wrong for anything else."""
        if not isinstance(value, dict):
            raise ConfigError(f"a stream record must be an object, not {type(value).__name__}")
        name = value.get("name", "")
        writers = value.get("writers", [])
        tables = value.get("tables")
        if not isinstance(writers, list):
            raise ConfigError(f"stream record {name!r}: writers must be a list, not {writers!r}")
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            raise ConfigError(f"stream record {name!r}: tables must be a list of objects")
        try:
            table_specs = tuple(TableSpec(**t) for t in tables)
        except TypeError as err:  # a key missing, unknown, or not a string
            raise ConfigError(f"stream record {name!r}: bad table ({err})") from None
        return cls(  # the constructors check every value
            name=name,
            sequence=value.get("sequence", ""),
            writers=tuple(writers),
            backwards=value.get("backwards", False),
            tables=table_specs,
        )
