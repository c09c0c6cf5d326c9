"""What the synchronous readers learn from the database (the Spark source on the
driver, `plait tail`, the demo): the stream's spec (recorded in `plait_streams` when a
writer creates it), its tables' columns, the writers' positions (`stream_positions`),
its sequence head, where a read limit cuts, pages of rows, and the writers' compact ids
in `instance_map` (registering those without one). Plain psycopg (Spark calls the
source synchronously).

Offsets and tokens are checked here against the stream they are used on (`check`): no
position past the sequence head (a token of another database, deployment or an older
incarnation of the stream, or a stored position nobody could have reached), no writer
the stream does not have. Every caller checks before it plans any work by them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import psycopg
from psycopg import sql

from plait.core.offsets import WriterRange, above_head, not_a_writer
from plait.core.spec import StreamSpec, TableSpec
from plait.core.tokens import StreamToken, decode_text
from plait.errors import ConfigError
from plait.storage.range_sql import page_query, range_condition
from plait.storage.recorded import head_of, head_query, ident, spec_columns, spec_from_row
from plait.storage.server_errors import CHECK_DSN, connect_or_say

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    pg_type: str  # format_type(): "bigint", "numeric(10,2)", "timestamp with time zone", ...


def connect(dsn: str) -> psycopg.Connection[Any]:
    """A connection for the driver's and planners' questions; a partition ends it
    within the default `DatabaseTimeouts` instead of leaving Spark waiting for hours
    (what the DSN sets itself wins)."""
    fix = f"{CHECK_DSN} of the dsn option"
    return connect_or_say(dsn, fix, autocommit=True, connect_timeout=10)


def load_spec(conn: psycopg.Connection[Any], stream: str) -> StreamSpec:
    try:
        row = conn.execute(
            sql.SQL("SELECT {} FROM plait_streams WHERE stream_name = %s").format(spec_columns()),
            (stream,),
        ).fetchone()
    except psycopg.errors.UndefinedTable:
        raise ConfigError(
            "plait source: this database has no plait streams (no plait_streams table in "
            "its search_path): check the DSN's database and schema (--schema on the command "
            "line; `plait demo` works in plait_demo)"
        ) from None
    if row is None:
        known = [r[0] for r in conn.execute("SELECT stream_name FROM plait_streams ORDER BY 1")]
        raise ConfigError(
            f"plait source: unknown stream {stream!r}; streams in this database: {known} "
            "(a stream is recorded when its first writer starts; an in-memory stream, kind "
            "memory, is never stored: its rows reach the instances over replication only)"
        )
    spec = spec_from_row(row)
    if spec.any_writer:
        raise ConfigError(
            f"plait source: stream {stream!r} lets any instance write and records no "
            "positions, so there is nothing to read it exactly once by; the source reads "
            "streams with configured writers"
        )
    return spec


def stream_uid(conn: psycopg.Connection[Any], stream: str) -> str | None:
    """The uid the database gave `stream` when it was first recorded (None in a
    database whose plait schema predates uids: its writers add them when they start)."""
    row = conn.execute(
        "SELECT to_jsonb(s) ->> 'stream_uid' FROM plait_streams s WHERE stream_name = %s",
        (stream,),
    ).fetchone()
    return None if row is None else row[0]


def tracks_commit_timestamps(conn: psycopg.Connection[Any]) -> bool:
    """Whether the server records when transactions commit (track_commit_timestamp)."""
    row = conn.execute("SELECT current_setting('track_commit_timestamp')").fetchone()
    return row is not None and row[0] == "on"


def pick_table(spec: StreamSpec, table: str | None) -> TableSpec:
    names = [t.name for t in spec.tables]
    if table is None:
        if len(spec.tables) == 1:
            return spec.tables[0]
        raise ConfigError(
            f"plait source: stream {spec.name!r} spans tables {names}; choose one (--table "
            'on the command line, .option("table", ...) in Spark)'
        )
    for candidate in spec.tables:
        if candidate.name == table:
            return candidate
    raise ConfigError(
        f"plait source: stream {spec.name!r} has no table {table!r}; its tables: {names}"
    )


def columns(conn: psycopg.Connection[Any], table: TableSpec) -> list[Column]:
    rows = conn.execute(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = to_regclass(%s) AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (table.name,),
    ).fetchall()
    if not rows:
        raise ConfigError(f"plait source: table {table.name!r} does not exist or has no columns")
    return [Column(name, pg_type) for name, pg_type in rows]


def latest(conn: psycopg.Connection[Any], spec: StreamSpec) -> StreamToken:
    """The offset every writer has persisted up to: each writer's row in
    `stream_positions` (never past what it completed), `min` the lowest of them.
    `ConfigError` if a row is past the sequence head: no writer can have reached it, so
    it is no position to read up to."""
    sign = spec.sign
    # The head in the same statement: the sequence is read after the rows' snapshot,
    # and it only grows, so no row a writer stored honestly can be past it.
    try:
        rows = conn.execute(
            sql.SQL(
                "SELECT s.last_value, s.is_called, p.instance_name, p.stream_id FROM {} s"
                " LEFT JOIN stream_positions p ON p.stream_name = %s"
            ).format(ident(spec.sequence)),
            (spec.name,),
        ).fetchall()
    except psycopg.errors.UndefinedTable:
        raise _no_sequence(spec) from None
    if not rows:  # a sequence always has its one row
        raise AssertionError(f"sequence {spec.sequence} returned no row")
    head = _counted(head_of(rows[0][:2]))
    positions = {
        writer: sign * position
        for *_, writer, position in rows
        if writer is not None and (not spec.writers or writer in spec.writers)
    }
    for writer, position in sorted(positions.items()):
        if position > head:
            raise ConfigError(
                f"plait source: stream_positions records writer {writer!r} at {position} "
                f"for stream {spec.name!r}, above its sequence head {head} (the largest "
                "ID the stream has handed out): the row is not a position any writer "
                "reached, so nothing is read up to it. If the sequence was reset or the "
                "database restored from an older backup, stop the stream's writers, run "
                f"DELETE FROM stream_positions WHERE stream_name = '{spec.name}'; and "
                "start them again"
            )
    if not positions:
        return StreamToken(1)  # nothing written yet: ID 1 is taken when the sequence is made
    return StreamToken.normalised(min(positions.values()), positions)


def sequence_head(conn: psycopg.Connection[Any], spec: StreamSpec) -> int:
    """The largest ID (internal, as in tokens) the stream's sequence has handed out
    (`StreamStore.sequence_head`'s twin; ID 1 always counts as handed out)."""
    try:
        row = conn.execute(head_query(spec.sequence)).fetchone()
    except psycopg.errors.UndefinedTable:
        raise _no_sequence(spec) from None
    assert row is not None
    return _counted(head_of(row))


def _no_sequence(spec: StreamSpec) -> ConfigError:
    return ConfigError(
        f"plait source: stream {spec.name!r} has no sequence {spec.sequence!r} in this "
        "database: the stream was dropped or is being recreated; start one of its writers"
    )


def _counted(head: int) -> int:
    # ID 1 counts as handed out: plait takes it when it makes the sequence, and `latest`
    # of a stream nobody wrote to is 1.
    return max(head, 1)


class Refused(ConfigError):
    """A token or offset that is no position of the stream it was used on."""


def check(conn: psycopg.Connection[Any], spec: StreamSpec, token: StreamToken) -> None:
    """`Refused` saying why, if `token` is no offset of this stream (`offsets.refusal`
    against its sequence head and writers): one read of the head, and one query per
    table only when the token names writers the spec does not list. The message names
    no option: callers say where the token came from and what to do."""
    reason = above_head(token, sequence_head(conn, spec)) or not_a_writer(
        token, _known_writers(conn, spec, set(token.writers))
    )
    if reason is not None:
        raise Refused(reason)


# Writers a token may name beyond the spec's and still be looked up in the tables (a
# checkpoint names at most the writers a stream had); past it, they are refused unseen.
_MAX_UNLISTED = 64


def _known_writers(conn: psycopg.Connection[Any], spec: StreamSpec, named: set[str]) -> set[str]:
    """The stream's writers among `named`: the configured ones, and those with rows in
    its tables (a writer removed from the configuration after it wrote: offsets taken
    before the change may name it, and its rows are still read by name)."""
    unlisted = sorted(named - set(spec.writers))
    if not unlisted or len(unlisted) > _MAX_UNLISTED:
        return set(spec.writers)
    seen: set[str] = set()
    for table in spec.tables:
        # An index probe per name (the (instance, ID) index), never a scan of its rows.
        seen.update(
            name
            for (name,) in conn.execute(
                sql.SQL(
                    "SELECT n FROM unnest(%s::text[]) AS n"
                    " WHERE EXISTS (SELECT 1 FROM {} WHERE {} = n)"
                ).format(ident(table.name), sql.Identifier(table.instance_column)),
                (unlisted,),
            )
        )
    return set(spec.writers) | seen


class Ask(Protocol):
    """Runs `work` with a catalog connection and returns what it returns."""

    def __call__(self, work: Callable[[psycopg.Connection[Any]], T], /) -> T: ...


class OnConnection:
    """An `Ask` on one given connection (the caller opens and closes it)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def __call__(self, work: Callable[[psycopg.Connection[Any]], T], /) -> T:
        return work(self.conn)


def parse_token(spec: StreamSpec, value: str, run: Ask) -> StreamToken:
    """A starting or ending point: "earliest", "latest", a token's text form (s5,
    m3~1.5) or its JSON form, checked against the stream (`check`). `ValueError`
    (`TokenParseError`, `ConfigError`) saying what is wrong, naming no option."""
    from plait.core.offsets import Identity, foreign, parse

    text = value.strip()
    if text == "earliest":
        return StreamToken(0)
    if text == "latest":
        return run(lambda conn: latest(conn, spec))
    if text.startswith("{"):
        token, named = parse(text)  # an offset a progress line printed, say
        if named is not None:
            uid = run(lambda conn: stream_uid(conn, spec.name))
            if why := foreign(named, Identity(spec.name, uid)):
                raise Refused(why)
    else:
        low, by_id = decode_text(text)
        if by_id:
            names = run(
                lambda conn: dict(
                    conn.execute(
                        "SELECT instance_id, instance_name FROM instance_map"
                        " WHERE instance_id = ANY(%s)",
                        (sorted(by_id),),
                    ).fetchall()
                )
            )
            token = StreamToken.named(text, low, by_id, names)
        else:
            token = StreamToken(low)
    run(lambda conn: check(conn, spec, token))
    return token


# What to do about a token refused by `check`, for a user who passed it.
FOREIGN_TOKEN = (
    "the token comes from another database or deployment, or from before the stream was "
    "recreated or the database restored; pass earliest, latest or a token this database gave"
)
# ... and for a checkpoint whose offsets are refused.
FOREIGN_CHECKPOINT = (
    "the checkpoint belongs to another stream, database or deployment, or the stream was recreated "
    "or the database restored from an older backup since it was written: delete the "
    "checkpoint (or use a new checkpoint location), and start again from startingToken"
)


def cutoff(
    conn: psycopg.Connection[Any],
    spec: StreamSpec,
    table: TableSpec,
    ranges_: list[WriterRange],
    max_rows: int,
) -> int | None:
    """The internal ID of the `max_rows`-th row of `table` in these ranges, or None
    when they hold fewer rows: cut there to read at most about `max_rows`."""
    if not ranges_:
        return None
    # The raw column, ordered the way its indexes are (descending for a backwards
    # stream's negative IDs), each range limited on its own: PostgreSQL reads at most
    # `max_rows` entries of an index per range instead of sorting every pending row
    # (from "earliest", that is the whole table at every trigger).
    order = sql.SQL("DESC" if spec.backwards else "ASC")
    parts = [
        sql.SQL("(SELECT {i} AS id FROM {t} WHERE {c} ORDER BY {i} {o} LIMIT {n})").format(
            i=sql.Identifier(table.id_column),
            t=ident(table.name),
            c=range_condition(table, spec.backwards, r),
            o=order,
            n=sql.Literal(max_rows),
        )
        for r in ranges_
    ]
    query = sql.SQL("SELECT id FROM ({}) AS pending ORDER BY id {} LIMIT 1 OFFSET {}").format(
        sql.SQL(" UNION ALL ").join(parts), order, sql.Literal(max_rows - 1)
    )
    row = conn.execute(query).fetchone()
    return None if row is None else spec.sign * int(row[0])


def pending_counts(
    conn: psycopg.Connection[Any],
    table: TableSpec,
    backwards: bool,
    ranges_: list[WriterRange],
    cap: int,
) -> list[int]:
    """The rows of `table` in each range, in order, each counted up to `cap` (a count
    of `cap` means at least that many): PostgreSQL walks at most `cap` entries of the
    (writer, ID) index per range, however far behind a query is."""
    if not ranges_:
        return []
    parts = [
        sql.SQL("(SELECT count(*) FROM (SELECT 1 FROM {t} WHERE {c} LIMIT {n}) AS r)").format(
            t=ident(table.name), c=range_condition(table, backwards, r), n=sql.Literal(cap)
        )
        for r in ranges_
    ]
    row = conn.execute(sql.SQL("SELECT ARRAY[{}]").format(sql.SQL(", ").join(parts))).fetchone()
    assert row is not None
    return [int(n) for n in row[0]]


def instance_ids(conn: psycopg.Connection[Any], names: Sequence[str]) -> dict[str, int]:
    """The compact ids of these writers in `instance_map` (which token texts use),
    registering those that have none yet, as `StreamToken.to_string` does."""
    conn.execute(
        "INSERT INTO instance_map (instance_name) SELECT unnest(%s::text[])"
        " ON CONFLICT (instance_name) DO NOTHING",
        (list(names),),
    )
    found = conn.execute(
        "SELECT instance_name, instance_id FROM instance_map WHERE instance_name = ANY(%s)",
        (list(names),),
    )
    return {str(name): int(id_) for name, id_ in found}


def read_page(
    conn: psycopg.Connection[Any],
    table: TableSpec,
    backwards: bool,
    ranges: Sequence[WriterRange],
    limit: int,
    *,
    newest_first: bool,
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """`page_query`'s rows: the names of the columns after the ID, and the rows (the
    stored ID first)."""
    with conn.cursor() as cur:
        cur.execute(page_query(table, backwards, ranges, limit, newest_first=newest_first))
        names = [c.name for c in cur.description or []][1:]  # after the ID
        return names, cur.fetchall()
