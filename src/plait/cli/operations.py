"""The operator's commands: `migrate`, `status` and `tail`."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

import click

from plait.cli.common import _ANY_DSN, _SCHEMA, _SECONDS, _console, _database, _Printer, _say
from plait.cli.group import main


@main.command()
@_ANY_DSN
@_SCHEMA
def migrate(dsn: str | None, schema: str | None) -> None:
    """Create or update plait's own tables (instances also do this when they start)."""
    import asyncio

    from plait.storage.database import Database

    async def run(url: str) -> None:
        db = await Database.connect(url, min_size=1, max_size=1)
        try:
            await db.migrate(report=click.echo)
        finally:
            await db.close()

    with _database(dsn, schema) as url:
        asyncio.run(run(url))


@main.command()
@_ANY_DSN
@_SCHEMA
@click.option(
    "--watch",
    is_flag=True,
    help="Redraw every --every seconds until Ctrl-C, with how fast each writer moves.",
)
@click.option(
    "--every", type=_SECONDS, default=1.0, show_default=True, help="Seconds between redraws."
)
@click.option(
    "--stall-after",
    type=_SECONDS,
    default=30.0,
    show_default=True,
    help="Seconds the writer holding a stream back may keep its row still while others "
    "are ahead before the stream counts as stalled.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON line per stream instead.")
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    help="The deployment's YAML config: its instance_map tells where each instance's "
    "/metrics is, for the age of every writer's oldest unfinished ID; its database is "
    "the default --dsn.",
)
def status(
    dsn: str | None,
    schema: str | None,
    watch: bool,
    every: float,
    stall_after: float,
    as_json: bool,
    config_file: str | None,
) -> None:
    """Every stream and writer: position, persisted-up-to, gap, age of the position
    row and, with --config, age of the oldest unfinished ID. Exits 1 when a stream is
    stalled (after --watch: as last drawn)."""
    import psycopg

    from plait.ops import status as ops
    from plait.storage import stream_records as records
    from plait.storage.server_errors import connect_or_say
    from plait.storage.timeouts import connect_sync

    instances: dict[str, str] = {}
    if config_file is not None:
        from plait.config import InstanceConfig

        # One file serves every instance of a deployment; status is none of them.
        config = InstanceConfig.from_yaml(config_file, instance_name="plait-status")
        instances = dict(config.instance_map)
        dsn = dsn or config.database

    def look(
        conn: psycopg.Connection[Any],
    ) -> tuple[list[records.RecordedStream], list[ops.StreamStatus], dict[str, str]]:
        pending, failed = ops.scrape(instances)
        streams = records.read(conn)
        return streams, [ops.assess(s, stall_after, pending) for s in streams], failed

    with _database(dsn, schema) as url, connect_or_say(url, autocommit=True) as conn:
        records.check_schema(conn)
        if not watch:
            _, found, failed = look(conn)
            if as_json:
                for stream in found:
                    click.echo(ops.to_json(stream))
            else:
                _console().print(_status_table(found, None, 0.0, failed, bool(instances)))
            for name, why in failed.items():
                click.echo(f"no metrics from {name}: {why}", err=True)
            sys.exit(1 if any(s.stalled for s in found) else 0)
        from rich.live import Live

        from plait.ops.reconnect import Reconnecting

        before: list[ops.StreamStatus] | None = None
        found, taken = [], time.monotonic()

        def poll(conn: psycopg.Connection[Any]) -> Any:
            streams, found, failed = look(conn)
            return found, failed, records.rows_written(conn, streams, ops.positions(before or []))

        link = Reconnecting(conn, lambda: connect_sync(url, autocommit=True), url, _say)
        console = _console()
        # Redrawn in place on a terminal; into a file or a pipe, one table per look
        # (Live drew there only once it stopped).
        with (
            (
                Live(console=console, auto_refresh=False)
                if console.is_terminal
                else _Printer(console)
            ) as live,
            contextlib.suppress(KeyboardInterrupt),
        ):
            while True:
                now = time.monotonic()
                found, failed, rows = link.run(poll)
                table = _status_table(found, before, now - taken, failed, bool(instances), rows)
                live.update(table, refresh=True)
                before, taken = found, now
                time.sleep(every)
        link.close()
        sys.exit(1 if any(s.stalled for s in found) else 0)


@main.command()
@click.argument("stream")
@_ANY_DSN
@_SCHEMA
@click.option(
    "--from",
    "from_",
    metavar="TOKEN",
    help="Print the rows after this token (s5, m3~1.7, its JSON form, earliest or "
    "latest); default: the last --lines rows.",
)
@click.option(
    "-n",
    "--lines",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Rows to show without --from.",
)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new rows until Ctrl-C.")
@click.option("--writer", help="Only this writer's rows (tokens then resume only its rows).")
@click.option(
    "--every",
    type=_SECONDS,
    default=0.5,
    show_default=True,
    help="Seconds between polls (--follow).",
)
def tail(
    stream: str,
    dsn: str | None,
    schema: str | None,
    from_: str | None,
    lines: int,
    follow: bool,
    writer: str | None,
    every: float,
) -> None:
    """A stream's rows as JSON lines: {"token", "table", "row"}. Each token resumes
    right after its row (`--from TOKEN`); rows are only ever ones their writer persisted."""
    from plait.ops.tail import Tail
    from plait.storage.server_errors import connect_or_say
    from plait.storage.timeouts import connect_sync

    with _database(dsn, schema) as url, connect_or_say(url, autocommit=True) as conn:
        reader = Tail(conn, stream, writer)

        def shown(line: Any) -> str:
            return str(line.to_json(reader.text(line.token)))

        end = reader.latest()
        if from_ is None:
            for line in reader.last(lines, end):
                click.echo(shown(line))
        else:
            try:
                start = reader.token(from_)
            except ValueError as err:  # TokenParseError, or no token of this stream
                raise click.BadParameter(str(err), param_hint="'--from'") from None
            end = start.copy_and_advance(end)
            for line in reader.between(start, end):
                click.echo(shown(line))
        if not follow:
            return
        from plait.ops.reconnect import Reconnecting

        def poll(conn: Any) -> tuple[Any, list[str]]:
            """The rows after `end`, as printed: all of them or none (then again)."""
            reader.conn = conn
            newer = end.copy_and_advance(reader.latest())
            lines = [shown(line) for line in reader.between(end, newer)]
            return newer, lines

        link = Reconnecting(conn, lambda: connect_sync(url, autocommit=True), url, _say)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(every)
                end, printed = link.run(poll)
                for text in printed:
                    click.echo(text)
        link.close()


def _status_table(
    found: list[Any],
    before: list[Any] | None,
    seconds: float,
    failed: dict[str, str],
    scraped: bool,
    rows: dict[tuple[str, str], int] | None = None,
) -> Any:
    """`scraped`: the instances' metrics were asked for (--config): show the oldest
    pending ID's age per writer. With `before` (--watch): IDs/s and `rows`/s."""
    from rich.table import Table

    from plait.ops.status import rates

    caption = f"no metrics from {', '.join(sorted(failed))}" if failed else None
    table = Table(title="plait streams", title_justify="left", caption=caption)
    columns = ["stream", "writer", "position", "behind", "row age"]
    columns += ["oldest pending"] if scraped else []
    columns += ["IDs/s", "rows/s"] if before is not None else []
    for column in columns:
        table.add_column(column, justify="left" if column in ("stream", "writer") else "right")
    table.add_column("state")
    speeds = rates(before, found, seconds) if before is not None else {}
    for stream in found:
        table.add_row(
            f"[bold]{stream.name}[/]",
            "",
            _num(stream.head, "head "),
            *[""] * (len(columns) - 3),
            f"persisted up to {_num(stream.persisted_up_to)}, gap {stream.gap}",
        )
        for w in stream.writers:
            state = (
                "[red]STALLED[/]"
                if w.writer == stream.stalled_by
                else ("holding" if w.holding else ("no row yet" if w.position is None else "ok"))
            )
            speed = speeds.get((stream.name, w.writer))
            moved = (rows or {}).get((stream.name, w.writer), 0 if speed is not None else None)
            table.add_row(
                "",
                w.writer,
                _num(w.position),
                str(w.behind),
                "" if w.age is None else f"{w.age:.1f} s",
                *([_pending(w.pending_age)] if scraped else []),
                *([] if before is None else [_rate(speed), _rate(moved, seconds)]),
                state,
            )
    return table


def _rate(value: float | None, seconds: float = 1.0) -> str:
    return "" if value is None or seconds <= 0 else f"{value / seconds:.0f}"


def _pending(age: float | None) -> str:
    """The oldest unfinished ID's age: '?' when unknown (no metrics), '-' when none."""
    if age is None:
        return "?"
    return "-" if age == 0 else f"{age:.1f} s"


def _num(value: int | None, prefix: str = "") -> str:
    return "-" if value is None else f"{prefix}{value}"
