"""Which Spark filters the plait source pushes into its SQL, and as what (no I/O: the
Spark test `test_filters_of_a_batch_read_...` checks the SQL against Spark itself)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
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
from pyspark.sql.types import LongType, StringType, StructField, StructType

from plait.spark.pushdown import push, targets
from plait.spark.schema import infer
from plait.storage.catalog import Column

COLUMNS = [
    Column("id", "bigint"),
    Column("n", "integer"),
    Column("who", "text"),
    Column("v", "character varying(20)"),
    Column("c", "character(3)"),
    Column("amount", "numeric(12,2)"),
    Column("loose", "numeric"),
    Column("nm", "name"),
    Column("d", "double precision"),
    Column("r", "real"),
    Column("ok", "boolean"),
    Column("doc", "jsonb"),
    Column("at", "timestamp with time zone"),
]
TARGETS = targets(COLUMNS, infer(COLUMNS))


def T(column: str) -> str:
    """A text column as pushed SQL has it."""
    return f'("{column}"::text COLLATE "C")'


def sql_of(where: Filter) -> str | None:
    pushed, kept = push([where], TARGETS)
    if kept:
        assert kept == [where]
        assert kept[0] is where
        assert not pushed
        return None
    (condition,) = pushed
    return condition.as_string(None)


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (EqualTo(("id",), 5), '("id" = 5)'),
        (GreaterThan(("id",), -3), '("id" >  -3)'),
        (GreaterThanOrEqual(("n",), 1), '("n" >= 1)'),
        (LessThan(("amount",), Decimal("9.50")), '("amount" < 9.50::numeric)'),
        (LessThanOrEqual(("d",), float("nan")), "(\"d\" <= 'nan'::float8)"),
        (
            EqualNullSafe(("who",), "w1"),
            '(("who"::text COLLATE "C") IS NOT DISTINCT FROM \'w1\'::text)',
        ),
        (
            In(("who",), ("w1", None, "it's")),
            "((\"who\"::text COLLATE \"C\") IN ('w1'::text, NULL, 'it''s'::text))",
        ),
        (EqualTo(("nm",), "x" * 3), '(("nm"::text COLLATE "C") = \'xxx\'::text)'),
        (IsNull(("v",)), f"({T('v')} IS NULL)"),
        (IsNotNull(("at",)), '("at" IS NOT NULL)'),
        (Not(EqualTo(("ok",), True)), '(NOT ("ok" = true))'),
        (StringStartsWith(("who",), "a%_"), f"starts_with({T('who')}, 'a%_'::text)"),
        (StringEndsWith(("v",), "z"), f"(right({T('v')}, char_length('z'::text)) = 'z'::text)"),
        (StringContains(("doc",), '"k"'), f"(strpos({T('doc')}, '\"k\"'::text) > 0)"),
        (EqualTo(("doc",), '{"k": 3}'), f"({T('doc')} = '{{\"k\": 3}}'::text)"),
    ],
)
def test_a_filter_postgresql_applies_as_spark_does_is_pushed_as_sql(
    where: Filter, expected: str
) -> None:
    assert sql_of(where) == expected


@pytest.mark.parametrize(
    "where",
    [
        EqualTo(("c",), "ab "),  # char(n): Spark sees the padding
        GreaterThan(("who",), "m"),  # text order: the column's collation, not code points
        LessThan(("doc",), "x"),
        EqualTo(("r",), 0.1),  # real: compared as float4 by Spark, float8 by the literal
        GreaterThan(("at",), "2020-01-01"),  # timestamps: time zones
        EqualTo(("ok",), 1),  # a value of another type than the column's
        EqualTo(("who",), "nul\x00"),  # PostgreSQL text holds no NUL
        In(("who",), ("w1", "nul\x00")),
        In(("id",), ()),
        EqualTo(("nested", "field"), 1),
        EqualTo(("missing",), 1),
        StringStartsWith(("id",), "1"),
        GreaterThan(("ok",), False),
        IsNull(("nested", "field")),
        Not(GreaterThan(("who",), "m")),
        EqualTo(("amount",), Decimal("NaN")),
        EqualTo(("loose",), Decimal("1")),  # unconstrained numeric: Spark's values are cut
    ],
)
def test_a_filter_it_may_not_apply_exactly_stays_with_spark(where: Filter) -> None:
    assert sql_of(where) is None


def test_a_column_read_as_text_by_the_users_schema_is_filtered_as_that_text() -> None:
    """A user schema that reads a bigint as a string: the SQL selects it as ::text, and
    the filter compares that text, not the number."""
    schema = StructType([StructField("id", StringType()), StructField("n", LongType())])
    columns = targets(COLUMNS, schema)
    assert columns["n"].kind == "other"  # integer read as long: NULL tests only
    pushed, kept = push([EqualTo(("id",), "7"), EqualTo(("n",), 7)], columns)
    assert [p.as_string(None) for p in pushed] == ['(("id"::text COLLATE "C") = \'7\'::text)']
    assert kept == [EqualTo(("n",), 7)]


FILTERS = st.one_of(
    st.builds(EqualTo, st.sampled_from([("id",), ("who",), ("at",), ("x", "y")]), st.integers()),
    st.builds(IsNull, st.sampled_from([("id",), ("who",), ("r",)])),
    st.builds(GreaterThan, st.sampled_from([("who",), ("id",)]), st.text(max_size=3)),
)


@given(st.lists(FILTERS, max_size=8))
def test_every_filter_is_either_pushed_or_given_back_in_order(filters: list[Any]) -> None:
    pushed, kept = push(filters, TARGETS)
    assert len(pushed) + len(kept) == len(filters)
    positions = [next(i for i, f in enumerate(filters) if f is k) for k in kept]
    assert positions == sorted(positions)


def test_a_collated_string_type_in_the_users_schema_is_not_compared_as_bytes() -> None:
    from pyspark.sql.types import StringType as Strings

    collated = Strings("UTF8_LCASE")
    schema = StructType([StructField("who", collated)])
    assert targets(COLUMNS, schema)["who"].kind == "other"


def test_spark_still_checks_pushdown_by_the_base_method_plait_presents() -> None:
    """`_Pushdown` passes Spark's "pushdown is off" check by presenting the base method
    (plait.spark.source); this pins the check it relies on in the installed PySpark."""
    import inspect

    from pyspark.sql.datasource import DataSourceReader
    from pyspark.sql.worker import plan_data_source_read

    from plait.spark.source import _Pushdown

    assert getattr(_Pushdown(lambda filters: filters), "__func__", None) is (
        DataSourceReader.pushFilters
    )
    text = inspect.getsource(plan_data_source_read)
    assert (
        'getattr(reader.pushFilters, "__func__", None) is not DataSourceReader.pushFilters' in text
    )
