"""Spark filters pushed into the database: which of a batch read's filters PostgreSQL
can apply exactly as Spark would, so that only the matching rows leave the database (no
I/O here; the SQL itself is `plait.storage.filters`').

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

from collections.abc import Iterable, Mapping

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
from plait.storage import filters
from plait.storage.catalog import Column
from plait.storage.filters import FilterColumn, Match, Order

_ORDER: dict[type[Filter], Order] = {
    GreaterThan: ">",
    GreaterThanOrEqual: ">=",
    LessThan: "<",
    LessThanOrEqual: "<=",
}
_MATCH: dict[type[Filter], Match] = {
    StringStartsWith: "starts_with",
    StringEndsWith: "ends_with",
    StringContains: "contains",
}
_PG_TEXT = ("text", "character varying", "varchar", "name")


def targets(columns: Iterable[Column], schema: StructType) -> dict[str, FilterColumn]:
    """The columns of `schema` a filter can be pushed on, by name."""
    by_name = {c.name: c for c in columns}
    return {
        field.name: _target(by_name[field.name], field.dataType)
        for field in schema.fields
        if field.name in by_name
    }


def _target(column: Column, spark_type: DataType) -> FilterColumn:
    """The column, of the kind whose values compare in SQL exactly as Spark compares
    them (`other`: only NULL tests)."""
    mapped = map_column(column)
    native = spark_type == mapped.field.dataType
    if native and isinstance(spark_type, LongType | IntegerType | ShortType | ByteType):
        return FilterColumn(column.name, "integer")
    if native and isinstance(spark_type, DecimalType) and "(" in column.pg_type:
        return FilterColumn(column.name, "numeric")
    if native and isinstance(spark_type, DoubleType):
        return FilterColumn(column.name, "double")
    if native and isinstance(spark_type, BooleanType):
        return FilterColumn(column.name, "boolean")
    if spark_type == StringType():  # not a collated string type: those compare otherwise
        if native and not mapped.as_text and not _plain_text(column.pg_type):
            return FilterColumn(column.name, "other")  # char(n): Spark sees the padding
        return FilterColumn(column.name, "text")
    return FilterColumn(column.name, "other")


def _plain_text(pg_type: str) -> bool:
    return pg_type.split("(")[0] in _PG_TEXT


def condition(where: Filter, columns: Mapping[str, FilterColumn]) -> sql.Composable | None:
    """`where` as a SQL condition that keeps exactly the rows Spark's filter keeps, or
    None when it cannot be pushed."""
    if isinstance(where, Not):
        inner = condition(where.child, columns)
        return None if inner is None else filters.negation(inner)
    path: tuple[str, ...] = tuple(getattr(where, "attribute", ()))
    if len(path) != 1 or path[0] not in columns:
        return None  # a nested field, or a column without a target
    column = columns[path[0]]
    if isinstance(where, IsNull | IsNotNull):
        return filters.is_null(column, negated=isinstance(where, IsNotNull))
    if isinstance(where, In):
        return filters.one_of(column, where.value)
    value = getattr(where, "value", None)
    if isinstance(where, EqualTo | EqualNullSafe):
        return filters.equal(column, value, null_safe=isinstance(where, EqualNullSafe))
    if type(where) in _ORDER:
        return filters.ordered(column, _ORDER[type(where)], value)
    if type(where) in _MATCH:
        return filters.matches(column, _MATCH[type(where)], value)
    return None


def push(
    filters_: Iterable[Filter], columns: Mapping[str, FilterColumn]
) -> tuple[list[sql.Composable], list[Filter]]:
    """The SQL conditions of the filters that can be pushed, and the filters that stay
    with Spark (the same objects, as Spark asks)."""
    pushed: list[sql.Composable] = []
    kept: list[Filter] = []
    for where in filters_:
        translated = condition(where, columns)
        if translated is None:
            kept.append(where)
        else:
            pushed.append(translated)
    return pushed, kept
