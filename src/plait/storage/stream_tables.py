"""The SQL of one stream table: its queries (all in the stored domain, negated for a
backwards stream), and the row type every read returns."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from psycopg import AsyncCursor, sql

from plait.core.spec import TableSpec
from plait.storage.recorded import ident

logger = logging.getLogger(__name__)


# Builds rows of one table from its columns, a batch at a time:
# (table, [(name, type oid)]) -> (list of tuples -> list of rows).
RowMaker = Callable[[str, list[tuple[str, int]]], Callable[[list[tuple[Any, ...]]], list[Any]]]


async def open_scan(
    cur: AsyncCursor[Any], table: StreamTable, writer: str, from_exclusive: int, to_inclusive: int
) -> list[tuple[str, int]]:
    """Start `writer`'s rows of (from, to] on a server-side cursor; its columns (name,
    type oid)."""
    params = {
        "writer": writer,
        "lo": table.stored(from_exclusive),
        "hi": table.stored(to_inclusive),
    }
    await cur.execute(table.range_query(True, limited=False), params)
    return [(column.name, column.type_code) for column in cur.description or ()]


def safe_bound(reached: list[int | None]) -> int | None:
    """The largest ID whose rows every table has returned in full: just below the
    lowest ID a still-open table has reached (its rows of that ID may go on). None
    when every table was read to the end."""
    open_ = [last for last in reached if last is not None]
    return min(open_) - 1 if open_ else None


class StreamRow(NamedTuple):
    """One row of a stream table. `stream_id` is as stored (negative when backwards).
    A named tuple: catch-up builds millions of them."""

    stream_id: int
    instance_name: str
    table: str
    data: dict[str, Any]


FLOOR = sql.SQL("%(floor)s")


class StreamTable:
    """SQL fragments for one table of a stream."""

    def __init__(self, spec: TableSpec, backwards: bool) -> None:
        self.spec = spec
        self.name = spec.name
        self.table = ident(spec.name)
        self.id = sql.Identifier(spec.id_column)
        self.inst = sql.Identifier(spec.instance_column)
        self.backwards = backwards
        # Forwards: internal = stored, "above x" is `> x`, ascending order.
        # Backwards: internal = -stored, "above x" is `< -x`, descending order.
        self.above = sql.SQL("<" if backwards else ">")
        self.at_most = sql.SQL(">=" if backwards else "<=")
        self.order = sql.SQL("DESC" if backwards else "ASC")
        self.extreme = sql.SQL("MIN" if backwards else "MAX")
        self.indexed = True  # an index on (instance, id): per-writer reads, start-up
        self.id_indexed = True  # an index led by the id: reads across writers
        self.warned_scan = False
        self.columns: frozenset[str] = frozenset()  # all of them, from check_tables

    def stored(self, internal: int) -> int:
        return -internal if self.backwards else internal

    def _writers_cte(self) -> sql.Composed:
        # Distinct writer names through the (instance, id) index, one probe per name.
        return sql.SQL(
            "WITH RECURSIVE w(name) AS ("
            " (SELECT {inst} FROM {t} ORDER BY {inst} LIMIT 1)"
            " UNION ALL"
            " SELECT (SELECT {inst} FROM {t} WHERE {inst} > w.name ORDER BY {inst} LIMIT 1)"
            " FROM w WHERE w.name IS NOT NULL) "
        ).format(inst=self.inst, t=self.table)

    def max_query(self) -> sql.Composed:
        if not self.indexed:
            return sql.SQL("SELECT {agg}({id}) FROM {t}").format(
                agg=self.extreme, id=self.id, t=self.table
            )
        return self._writers_cte() + sql.SQL(
            "SELECT {agg}(x.m) FROM w CROSS JOIN LATERAL"
            " (SELECT {agg}({id}) AS m FROM {t} WHERE {inst} = w.name) x"
            " WHERE w.name IS NOT NULL"
        ).format(agg=self.extreme, id=self.id, t=self.table, inst=self.inst)

    def ids_above_query(self, floor: sql.Composable = FLOOR) -> sql.Composed:
        """IDs above `floor` (stored form), lowest first, at most %(n)s."""
        if not self.indexed:
            return sql.SQL(
                "SELECT {id} FROM {t} WHERE {id} {above} {floor} ORDER BY {id} {order} LIMIT %(n)s"
            ).format(id=self.id, t=self.table, above=self.above, order=self.order, floor=floor)
        return self._writers_cte() + sql.SQL(
            "SELECT x.id FROM w CROSS JOIN LATERAL"
            " (SELECT {id} AS id FROM {t} WHERE {inst} = w.name AND {id} {above} {floor}"
            "  ORDER BY {id} {order} LIMIT %(n)s) x"
            " WHERE w.name IS NOT NULL ORDER BY x.id {order} LIMIT %(n)s"
        ).format(
            id=self.id,
            inst=self.inst,
            t=self.table,
            above=self.above,
            order=self.order,
            floor=floor,
        )

    def own_max_above_query(self, floor: sql.Composable) -> sql.Composed:
        """The largest ID of writer %(inst)s above `floor` (stored form)."""
        return sql.SQL(
            "SELECT {agg}({id}) FROM {t} WHERE {inst} = %(inst)s AND {id} {above} {floor}"
        ).format(
            agg=self.extreme,
            id=self.id,
            t=self.table,
            inst=self.inst,
            above=self.above,
            floor=floor,
        )

    def range_query(self, by_writer: bool, *, limited: bool = True) -> sql.Composed:
        writer = (
            sql.SQL("{inst} = %(writer)s AND ").format(inst=self.inst) if by_writer else sql.SQL("")
        )
        return sql.SQL(
            "SELECT * FROM {t} WHERE {writer}{id} {above} %(lo)s AND {id} {at_most} %(hi)s"
            " ORDER BY {id} {order}" + (" LIMIT %(n)s" if limited else "")
        ).format(
            t=self.table,
            writer=writer,
            id=self.id,
            above=self.above,
            at_most=self.at_most,
            order=self.order,
        )

    def whole_id_query(self, by_writer: bool) -> sql.Composed:
        writer = (
            sql.SQL("{inst} = %(writer)s AND ").format(inst=self.inst) if by_writer else sql.SQL("")
        )
        return sql.SQL("SELECT * FROM {t} WHERE {writer}{id} = %(id)s").format(
            t=self.table, writer=writer, id=self.id
        )
