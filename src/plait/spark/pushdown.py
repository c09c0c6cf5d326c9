"""Spark filters as SQL: which of a batch read's filters PostgreSQL can apply exactly
as Spark would, so that only the matching rows leave the database (no I/O here).

A filter is pushed only where SQL gives every row the same answer Spark gives it, NULLs
included (both use three-valued logic, and a row whose filter is NULL is dropped by
both), so a pushed filter is not evaluated again. What is pushed, by the column's type
as Spark reads it:

- integers, decimals of a declared precision and scale (numeric(p,s)) and doubles: =,
  <=>, <, <=, >, >=, IN (PostgreSQL orders NaN above every number and equal to itself,
  as Spark does). Not an unconstrained numeric: Spark reads it as decimal(38,18), cut
  to 18 places, so its values are not the column's;
- booleans: =, <=>, IN;
- text, varchar, name, and columns Spark reads as their text form (json, uuid, ...):
  =, <=>, IN, startsWith, endsWith, contains, compared as text in the "C" collation
  (bytes, as Spark compares strings; a column's own collation may be case-insensitive).
  Not <, >: in a database whose encoding is not UTF-8, byte order is not Spark's.
  char(n) is not pushed (its padding);
- NOT of any of these.

IS [NOT] NULL is pushed on any column. Anything else (dates, timestamps, floats, char(n),
nested fields, strings holding NUL, which PostgreSQL text cannot) stays with Spark.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from psycopg import sql
from pyspark.sql.datasource import (
    EqualNullSafe,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    IsNotNull,
    IsNull,
    LessThan,
    LessThanOrEqual,
    Not,
    StringContains,
    StringEndsWith,
    StringStartsWith,
)
from pyspark.sql.types import (
    BooleanType,
    ByteType,
    DataType,
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
)

from plait.spark.schema import map_column
from plait.storage.catalog import Column

NUMBER, BOOLEAN, TEXT, OTHER = "number", "boolean", "text", "other"  # OTHER: NULL tests only
_COMPARE: dict[type[Filter], str] = {
    GreaterThan: ">",
    GreaterThanOrEqual: ">=",
    LessThan: "<",
    LessThanOrEqual: "<=",
}
_PG_TEXT = ("text", "character varying", "varchar", "name")


@dataclass(frozen=True, slots=True)
class Target:
    """How SQL reaches one column for a filter, and what kind of values it holds."""

    expression: sql.Composable
    kind: str  # NUMBER, BOOLEAN, TEXT or OTHER
    value: Callable[[Any], sql.Composable | None]  # None: this value is not pushed


def targets(columns: Iterable[Column], schema: StructType) -> dict[str, Target]:
    """The columns of `schema` a filter can be pushed on, by name."""
    by_name = {c.name: c for c in columns}
    return {
        field.name: _target(by_name[field.name], field.dataType)
        for field in schema.fields
        if field.name in by_name
    }


def _target(column: Column, spark_type: DataType) -> Target:
    name = sql.Identifier(column.name)
    mapped = map_column(column)
    native = spark_type == mapped.field.dataType
    if native and isinstance(spark_type, LongType | IntegerType | ShortType | ByteType):
        return Target(name, NUMBER, _integer)
    if native and isinstance(spark_type, DecimalType) and "(" in column.pg_type:
        return Target(name, NUMBER, _decimal)
    if native and isinstance(spark_type, DoubleType):
        return Target(name, NUMBER, _double)
    if native and isinstance(spark_type, BooleanType):
        return Target(name, BOOLEAN, _boolean)
    if spark_type == StringType():  # not a collated string type: those compare otherwise
        if native and not mapped.as_text and not _plain_text(column.pg_type):
            return Target(name, OTHER, _none)  # char(n): Spark sees the padding, ::text not
        # As the reader selects it (a no-op for text), in byte order.
        return Target(sql.SQL('({}::text COLLATE "C")').format(name), TEXT, _text)
    return Target(name, OTHER, _none)


def _none(value: Any) -> None:
    return None


def _plain_text(pg_type: str) -> bool:
    return pg_type.split("(")[0] in _PG_TEXT


def _integer(value: Any) -> sql.Composable | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return sql.Literal(value)


def _decimal(value: Any) -> sql.Composable | None:
    if isinstance(value, bool) or not isinstance(value, int | Decimal):
        return None
    if isinstance(value, Decimal) and not value.is_finite():
        return None
    return sql.SQL("{}::numeric").format(sql.Literal(value))


def _double(value: Any) -> sql.Composable | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return sql.SQL("{}::float8").format(sql.Literal(str(float(value))))


def _boolean(value: Any) -> sql.Composable | None:
    return sql.Literal(value) if isinstance(value, bool) else None


def _text(value: Any) -> sql.Composable | None:
    if not isinstance(value, str) or "\x00" in value:
        return None
    return sql.SQL("{}::text").format(sql.Literal(value))  # not cut to a name's 63 bytes


def condition(where: Filter, columns: Mapping[str, Target]) -> sql.Composable | None:
    """`where` as a SQL condition that keeps exactly the rows Spark's filter keeps, or
    None when it cannot be pushed."""
    if isinstance(where, Not):
        inner = condition(where.child, columns)
        return None if inner is None else sql.SQL("(NOT {})").format(inner)
    path: tuple[str, ...] = tuple(getattr(where, "attribute", ()))
    if len(path) != 1 or path[0] not in columns:
        return None  # a nested field, or a column without a target
    target = columns[path[0]]
    column = target.expression
    if isinstance(where, IsNull | IsNotNull):
        test = "IS NULL" if isinstance(where, IsNull) else "IS NOT NULL"
        return sql.SQL("({} {})").format(column, sql.SQL(test))
    if isinstance(where, In):
        if not where.value:
            return None
        listed_values: list[sql.Composable] = []
        for raw in where.value:
            literal = sql.NULL if raw is None else target.value(raw)
            if literal is None:
                return None  # one value that cannot be pushed: the whole IN stays
            listed_values.append(literal)
        listed = sql.SQL(", ").join(listed_values)
        return sql.SQL("({} IN ({}))").format(column, listed)
    value = target.value(getattr(where, "value", None))
    if value is None:
        return None
    if isinstance(where, EqualTo):
        return sql.SQL("({} = {})").format(column, value)
    if isinstance(where, EqualNullSafe):
        return sql.SQL("({} IS NOT DISTINCT FROM {})").format(column, value)
    if type(where) in _COMPARE and target.kind == NUMBER:
        return sql.SQL("({} {} {})").format(column, sql.SQL(_COMPARE[type(where)]), value)
    if target.kind == TEXT:
        if isinstance(where, StringStartsWith):
            return sql.SQL("starts_with({}, {})").format(column, value)
        if isinstance(where, StringEndsWith):
            return sql.SQL("(right({c}, char_length({v})) = {v})").format(c=column, v=value)
        if isinstance(where, StringContains):
            return sql.SQL("(strpos({}, {}) > 0)").format(column, value)
    return None


def push(
    filters: Iterable[Filter], columns: Mapping[str, Target]
) -> tuple[list[sql.Composable], list[Filter]]:
    """The SQL conditions of the filters that can be pushed, and the filters that stay
    with Spark (the same objects, as Spark asks)."""
    pushed: list[sql.Composable] = []
    kept: list[Filter] = []
    for where in filters:
        translated = condition(where, columns)
        if translated is None:
            kept.append(where)
        else:
            pushed.append(translated)
    return pushed, kept
