"""Row conditions as SQL, for filters pushed into a read (the Spark source's pushdown,
`plait.spark.pushdown`, decides which filters may be pushed; only this module writes
their SQL).

A column is reached as a `FilterColumn` of one kind, which fixes how its values become
literals: `integer`, `numeric` (a `numeric(p,s)` column), `double`, `boolean`, `text`
(compared in byte order, as `(col::text COLLATE "C")`), or `other` (only NULL tests).
`literal` answers None for a value that kind cannot compare exactly (a bool for an
integer, a non-finite Decimal, a string holding NUL): the caller then keeps the filter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

from psycopg import sql

Kind = Literal["integer", "numeric", "double", "boolean", "text", "other"]
Order = Literal["<", "<=", ">", ">="]
Match = Literal["starts_with", "ends_with", "contains"]
NUMBERS: frozenset[Kind] = frozenset({"integer", "numeric", "double"})


@dataclass(frozen=True, slots=True)
class FilterColumn:
    """One column as a condition reaches it."""

    name: str
    kind: Kind

    @property
    def expression(self) -> sql.Composable:
        name = sql.Identifier(self.name)
        if self.kind == "text":  # as the reader selects it (a no-op for text), byte order
            return sql.SQL('({}::text COLLATE "C")').format(name)
        return name

    def literal(self, value: Any) -> sql.Composable | None:
        """`value` as this column's SQL literal; None when it cannot be compared exactly."""
        return _LITERALS[self.kind](value)


def is_null(column: FilterColumn, *, negated: bool = False) -> sql.Composable:
    test = "IS NOT NULL" if negated else "IS NULL"
    return sql.SQL("({} {})").format(column.expression, sql.SQL(test))


def equal(column: FilterColumn, value: Any, *, null_safe: bool = False) -> sql.Composable | None:
    """`=`, or with `null_safe` `IS NOT DISTINCT FROM` (Spark's <=>)."""
    literal = column.literal(value)
    if literal is None:
        return None
    op = "IS NOT DISTINCT FROM" if null_safe else "="
    return sql.SQL("({} {} {})").format(column.expression, sql.SQL(op), literal)


def ordered(column: FilterColumn, op: Order, value: Any) -> sql.Composable | None:
    """A comparison, on numbers only."""
    literal = column.literal(value) if column.kind in NUMBERS else None
    if literal is None:
        return None
    return sql.SQL("({} {} {})").format(column.expression, sql.SQL(op), literal)


def one_of(column: FilterColumn, values: Sequence[Any]) -> sql.Composable | None:
    """`IN (...)`; None (SQL NULL) may be among the values. None when any value cannot
    be pushed (the whole IN stays with the caller), or there are none."""
    if not values:
        return None
    listed: list[sql.Composable] = []
    for value in values:
        literal = sql.NULL if value is None else column.literal(value)
        if literal is None:
            return None
        listed.append(literal)
    return sql.SQL("({} IN ({}))").format(column.expression, sql.SQL(", ").join(listed))


def matches(column: FilterColumn, how: Match, value: Any) -> sql.Composable | None:
    """A text column starts with, ends with or contains `value`."""
    literal = column.literal(value) if column.kind == "text" else None
    if literal is None:
        return None
    c = column.expression
    if how == "starts_with":
        return sql.SQL("starts_with({}, {})").format(c, literal)
    if how == "ends_with":
        return sql.SQL("(right({c}, char_length({v})) = {v})").format(c=c, v=literal)
    return sql.SQL("(strpos({}, {}) > 0)").format(c, literal)


def negation(condition: sql.Composable) -> sql.Composable:
    return sql.SQL("(NOT {})").format(condition)


def _integer(value: Any) -> sql.Composable | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return sql.Literal(value)


def _numeric(value: Any) -> sql.Composable | None:
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


def _nothing(value: Any) -> None:
    return None


_LITERALS: dict[Kind, Callable[[Any], sql.Composable | None]] = {
    "integer": _integer,
    "numeric": _numeric,
    "double": _double,
    "boolean": _boolean,
    "text": _text,
    "other": _nothing,
}


def all_of(conditions: Sequence[sql.Composable]) -> str | None:
    """The conditions joined by AND, as the text a read's query takes (`slice_query`'s
    `where`); None without any."""
    return sql.SQL(" AND ").join(conditions).as_string(None) if conditions else None
