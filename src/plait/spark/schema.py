"""Spark types for PostgreSQL columns, and how each column is selected so that the
Arrow batches the reader produces match them.

Like Spark's own JDBC source: integers, floats, booleans, text, bytea, dates and
timestamps map to their Spark types; numeric(p,s) to DecimalType(p,s) (unconstrained
numeric to DecimalType(38,18)); everything else (json, jsonb, uuid, intervals, arrays,
enums, ...) to its text form as a string.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from plait.errors import ConfigError
from plait.storage.catalog import Column

_NATIVE: dict[str, DataType] = {
    "bigint": LongType(),
    "integer": IntegerType(),
    "smallint": ShortType(),
    "boolean": BooleanType(),
    "real": FloatType(),
    "double precision": DoubleType(),
    "text": StringType(),
    "name": StringType(),
    "bytea": BinaryType(),
    "date": DateType(),
    "timestamp with time zone": TimestampType(),
    "timestamp without time zone": TimestampNTZType(),
}
_TEXTUAL = re.compile(r"^(character varying|character|varchar|char)(\(\d+\))?$")
_NUMERIC = re.compile(r"^numeric(?:\((\d+),(\d+)\))?$")
_TIMESTAMP = re.compile(r"^timestamp\(\d\) with(out)? time zone$")


@dataclass(frozen=True, slots=True)
class Mapped:
    """A column as Spark sees it, and whether SQL must turn it into text first
    (numeric too: the reader then casts the text to its decimal type)."""

    field: StructField
    as_text: bool


def map_column(column: Column) -> Mapped:
    pg = column.pg_type
    if pg in _NATIVE:
        return Mapped(StructField(column.name, _NATIVE[pg], True), False)
    if _TEXTUAL.match(pg):
        return Mapped(StructField(column.name, StringType(), True), False)
    timestamp = _TIMESTAMP.match(pg)
    if timestamp:
        moment: DataType = TimestampNTZType() if timestamp.group(1) else TimestampType()
        return Mapped(StructField(column.name, moment, True), False)
    numeric = _NUMERIC.match(pg)
    if numeric:
        precision, scale = numeric.groups()
        kind = DecimalType(38, 18) if precision is None else DecimalType(int(precision), int(scale))
        return Mapped(StructField(column.name, kind, True), True)
    return Mapped(StructField(column.name, StringType(), True), True)


def infer(columns: list[Column]) -> StructType:
    return StructType([map_column(c).field for c in columns])


def text_columns(columns: list[Column], schema: StructType) -> list[str]:
    """The columns of `schema` that SQL selects as text; every field of `schema` must
    be a column of the table."""
    by_name = {c.name: c for c in columns}
    missing = [f.name for f in schema.fields if f.name not in by_name]
    if missing:
        raise ConfigError(
            f"plait source: the schema names columns the table does not have: {missing}; "
            f"its columns: {list(by_name)}"
        )
    out: list[str] = []
    for field in schema.fields:
        mapped = map_column(by_name[field.name])
        if mapped.as_text or field.dataType != mapped.field.dataType:
            out.append(field.name)
    return out
