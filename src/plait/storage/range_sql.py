"""The SQL of per-writer ID ranges (`core.offsets.WriterRange`): a range's WHERE clause
in a table's stored form, a page of rows across ranges, and one Spark task's slice.
Values are written in as literals: a task runs its query as plain text on a connection
of its own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from psycopg import sql

from plait.core.offsets import Slice, WriterRange
from plait.core.spec import StreamSpec, TableSpec
from plait.storage.recorded import ident


def range_condition(table: TableSpec, backwards: bool, r: WriterRange) -> sql.Composed:
    """The WHERE clause of one range, in the table's stored form."""
    return sql.SQL("{} AND {}").format(_writers(table, r), _ids(table, backwards, r.low, r.high))


def page_query(
    table: TableSpec,
    backwards: bool,
    ranges: Sequence[WriterRange],
    limit: int,
    *,
    columns: Sequence[str] | None = None,
    where: sql.Composable | None = None,
    newest_first: bool = False,
) -> sql.Composed:
    """One page of a table's rows in `ranges`: the ID column, then `columns` (default:
    every column), in internal-ID order (newest first on request; a backwards stream
    stores its IDs negated), at most `limit`; `where` narrows it further (it is
    repeated in each range's subquery: write values into it as literals, not
    placeholders).

    Each range is read on its own, limited, as `cutoff` does: PostgreSQL then walks at
    most `limit` entries of the (writer, ID) index per range, where one query over all
    the ranges at once would sort every row in them for each page."""
    if not ranges:
        raise ValueError("page_query needs at least one range")
    order = sql.SQL("DESC" if newest_first != backwards else "ASC")
    picked = sql.SQL("*") if columns is None else sql.SQL(", ").join(map(sql.Identifier, columns))
    parts = []
    for r in ranges:
        condition = range_condition(table, backwards, r)
        if where is not None:
            condition = sql.SQL("({}) AND {}").format(where, condition)
        parts.append(
            sql.SQL(
                "(SELECT {id}, {picked} FROM {t} WHERE {c} ORDER BY {id} {o} LIMIT {n})"
            ).format(
                id=sql.Identifier(table.id_column),
                picked=picked,
                t=ident(table.name),
                c=condition,
                o=order,
                n=sql.Literal(limit),
            )
        )
    # By position: with every column picked, the ID column's name comes twice.
    return sql.SQL("SELECT * FROM ({}) AS page ORDER BY 1 {} LIMIT {}").format(
        sql.SQL(" UNION ALL ").join(parts), order, sql.Literal(limit)
    )


def slice_query(
    spec: StreamSpec,
    table: TableSpec,
    fields: Sequence[str],
    as_text: set[str],
    added: Mapping[str, str],
    piece: Slice,
    where: str | None,
) -> str:
    """The SELECT of one Spark task: `fields` of `table` for the IDs of `piece`, those in
    `as_text` read as text (types Arrow has no match for), those in `added` the
    metadata they name ("stream", "commitTimestamp"); `where` (SQL from pushed filters)
    narrows it. Plain text: the task runs it on a connection of its own."""

    def column(name: str) -> sql.Composable:
        if added.get(name) == "stream":
            return sql.SQL("{}::text AS {}").format(sql.Literal(spec.name), sql.Identifier(name))
        if added.get(name) == "commitTimestamp":
            return sql.SQL("pg_xact_commit_timestamp(xmin) AS {}").format(sql.Identifier(name))
        template = "{c}::text AS {c}" if name in as_text else "{c}"
        return sql.SQL(template).format(c=sql.Identifier(name))

    select = sql.SQL(", ").join(column(name) for name in fields)
    condition = slice_condition(table, spec.backwards, piece)
    if where is not None:
        condition = sql.SQL("{} AND {}").format(condition, sql.SQL(where))
    return (
        sql.SQL("SELECT {} FROM {} WHERE {}")
        .format(select, ident(table.name), condition)
        .as_string(None)
    )


def slice_condition(table: TableSpec, backwards: bool, piece: Slice) -> sql.Composed:
    """The WHERE clause of one slice: its ID span (what the index scan reads, once), then
    which writers' rows in it belong to the batch."""
    span = _ids(table, backwards, piece.low, piece.high)
    if piece.everyone:
        who: sql.Composable = sql.SQL("{} IS NOT NULL").format(
            sql.Identifier(table.instance_column)
        )
    else:
        who = sql.SQL(" OR ").join(
            _writers(table, r)
            if (r.low, r.high) == (piece.low, piece.high)
            else range_condition(table, backwards, r)
            for r in piece.ranges
        )
    return sql.SQL("{} AND ({})").format(span, who)


def _ids(table: TableSpec, backwards: bool, low: int, high: int) -> sql.Composed:
    ident = sql.Identifier(table.id_column)
    if backwards:  # stored IDs are negative: internal (low, high] is [-high, -low)
        return sql.SQL("{i} >= {a} AND {i} < {b}").format(
            i=ident, a=sql.Literal(-high), b=sql.Literal(-low)
        )
    return sql.SQL("{i} > {a} AND {i} <= {b}").format(
        i=ident, a=sql.Literal(low), b=sql.Literal(high)
    )


def _writers(table: TableSpec, r: WriterRange) -> sql.Composable:
    inst = sql.Identifier(table.instance_column)
    if r.writer is not None:
        return sql.SQL("{} = {}").format(inst, sql.Literal(r.writer))
    if r.others_than:
        return sql.SQL("{} <> ALL({}::text[])").format(inst, sql.Literal(list(r.others_than)))
    return sql.SQL("{} IS NOT NULL").format(inst)
