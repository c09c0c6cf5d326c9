"""The `plait` command line: the operator's commands (`status`, `tail`, `migrate`,
`serve`) and the Spark pipelines (`export`, `derive`), each exactly once across restarts
through its `--checkpoint` folder: run the same command again and it goes on where it
stopped. Commands that take `--dsn` without requiring it use plait's embedded
PostgreSQL when none is given, as the library does."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click

from plait.check.options import Options as _CHECK  # its defaults are the command's
from plait.check.plan import FAULT_KINDS
from plait.demo import SCHEMA as DEMO_SCHEMA
from plait.errors import ConfigError, DatabaseUnavailableError, InvalidDsnError, PlaitError
from plait.storage.embedded import dsn_or_embedded

_DSN = click.option(
    "--dsn",
    envvar="PLAIT_DSN",
    help="PostgreSQL the stream lives in (or $PLAIT_DSN) [default: plait's embedded server].",
)
_STREAM = click.option("--stream", required=True, help="The plait stream to read.")
# Durations and intervals: a zero or negative one is a mistyped flag, refused by name.
_SECONDS = click.FloatRange(min=0, min_open=True)
_ANY_DSN = click.option(
    "--dsn",
    envvar="PLAIT_DSN",
    help="PostgreSQL to use (or $PLAIT_DSN); default: plait's embedded server.",
)


_SCHEMA = click.option(
    "--schema",
    help="The PostgreSQL schema plait's tables and the streams' are in [default: the "
    "DSN's search_path].",
)


@contextlib.contextmanager
def _database(dsn: str | None, schema: str | None) -> Iterator[str]:
    """The DSN a command works on: `--dsn` or the embedded server's (started if need be,
    for as long as the command runs), in `--schema` when given."""
    from plait.storage.search_path import in_schema

    with dsn_or_embedded(dsn) as url:
        yield url if schema is None else in_schema(url, schema, "--schema")


def _spark_conf(_ctx: Any, _param: Any, values: tuple[str, ...]) -> dict[str, str]:
    conf: dict[str, str] = {}
    for value in values:
        key, sep, setting = value.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{value!r} is not KEY=VALUE", param_hint="'--conf'")
        conf[key.strip()] = setting
    return conf


def _duration_flag(_ctx: Any, param: Any, value: str | None) -> str | None:
    from plait.spark.options import duration

    if value is not None:
        try:
            duration(value)
        except ValueError as err:
            raise click.BadParameter(f"must be {err}", param=param) from None
    return value


def _source_options(command: Any) -> Any:
    for option in reversed(
        [
            _DSN,
            _SCHEMA,
            _STREAM,
            click.option("--table", help="For a stream over several tables: which one."),
            click.option(
                "--starting-token",
                default="earliest",
                show_default=True,
                help="Where a new checkpoint starts: earliest, latest or a token.",
            ),
            click.option(
                "--max-rows-per-trigger", type=click.IntRange(min=1), help="Rows per batch at most."
            ),
            click.option(
                "--min-rows-per-trigger",
                type=click.IntRange(min=1),
                help="Wait for this many rows before a batch (at most --max-trigger-delay).",
            ),
            click.option(
                "--max-trigger-delay",
                callback=_duration_flag,
                help="How long a batch waits for --min-rows-per-trigger rows, e.g. 30s, 5m "
                "[default: 15m].",
            ),
            click.option(
                "--checkpoint",
                required=True,
                type=click.Path(file_okay=False),
                help="Spark checkpoint folder: keep it to resume exactly once.",
            ),
            click.option(
                "--once",
                is_flag=True,
                help="Read what is there now, then stop (Trigger.AvailableNow); "
                "default: follow the stream until Ctrl-C.",
            ),
            click.option(
                "--master",
                help="Spark master: local[N], spark://host:port, yarn, k8s://... "
                "[default: local[*]].",
            ),
            click.option(
                "--remote",
                envvar="SPARK_REMOTE",
                help="A Spark Connect server to run on instead (sc://host:port, or "
                "$SPARK_REMOTE); its Python must have plait installed.",
            ),
            click.option(
                "--conf",
                multiple=True,
                metavar="KEY=VALUE",
                callback=_spark_conf,
                help="A Spark setting, as spark-submit takes it (repeat for several): "
                "e.g. --conf spark.executor.memory=2g.",
            ),
        ]
    ):
        command = option(command)
    return command


@click.group(invoke_without_command=True)
@click.version_option(package_name="plait", message="plait %(version)s")
@click.pass_context
def main(ctx: click.Context) -> None:
    """plait: multi-writer ordered streams on PostgreSQL."""
    if ctx.invoked_subcommand is None:  # bare `plait`: what there is, not an error
        click.echo(ctx.get_help())


@main.command()
@_source_options
@click.option(
    "--to",
    type=click.Choice(["parquet", "delta"]),
    default="parquet",
    show_default=True,
    help="Parquet files (Spark's file sink) or a Delta Lake table (deltalake).",
)
@click.option("--path", required=True, help="Output folder.")
@click.option("--partition-by", help="Partition the output by this column.")
@click.option("--partition-by-date", help="Partition by the date of this timestamp column.")
def export(**options: Any) -> None:
    """Export a stream to Parquet or Delta Lake, exactly once, one line per batch."""
    with _source_database(options):
        _export(options)


@contextlib.contextmanager
def _source_database(options: dict[str, Any]) -> Iterator[None]:
    """`--dsn`, or the embedded server's DSN (started if need be) for as long as the
    command runs, as the other commands do without --dsn."""
    with _database(options["dsn"], options.pop("schema")) as url:
        options["dsn"] = url
        yield


def _export(options: dict[str, Any]) -> None:
    from plait.spark import pipelines

    _check_before_spark(
        options,
        {
            "--partition-by": options["partition_by"],
            "--partition-by-date": options["partition_by_date"],
        },
    )
    spark, stop, printer = _spark(options)
    query = pipelines.export(
        spark,
        _source(options),
        to=options["to"],
        path=options["path"],
        checkpoint=options["checkpoint"],
        partition_by=options["partition_by"],
        partition_by_date=options["partition_by_date"],
        once=options["once"],
    )
    _ran(pipelines.run(query, on_stop=stop), options, printer)


@main.command()
@_source_options
@click.option(
    "--target-table", required=True, help="PostgreSQL table to keep (created if missing)."
)
@click.option("--key", required=True, help="The stream's column to key the table by.")
@click.option(
    "--kind",
    type=click.Choice(["latest", "counts"]),
    default="latest",
    show_default=True,
    help="The latest row per key, or row counts per key and hour.",
)
@click.option("--time-column", default="at", show_default=True, help="For counts: the time.")
@click.option("--target-dsn", envvar="PLAIT_TARGET_DSN", help="Default: --dsn.")
def derive(**options: Any) -> None:
    """Keep a PostgreSQL table from a stream; a replayed batch changes nothing."""
    with _source_database(options):
        _derive(options)


def _derive(options: dict[str, Any]) -> None:
    from plait.spark import pipelines

    counts = options["kind"] == "counts"
    _check_before_spark(
        options,
        {"--key": options["key"], "--time-column": options["time_column"] if counts else None},
    )
    spark, stop, printer = _spark(options)
    target = pipelines.Derived(
        dsn=options["target_dsn"] or options["dsn"],
        table=options["target_table"],
        key=options["key"],
        kind=options["kind"],
        time_column=options["time_column"],
    )
    query = pipelines.derive(
        spark, _source(options), target, checkpoint=options["checkpoint"], once=options["once"]
    )
    _ran(pipelines.run(query, on_stop=stop), options, printer)


@main.command()
@click.option(
    "--duration", type=_SECONDS, default=30.0, show_default=True, help="Seconds of simulated users."
)
@_ANY_DSN
@click.option(
    "--schema",
    default=DEMO_SCHEMA,
    show_default=True,
    help="The schema the demo works in (dropped and made again at every run).",
)
@click.option("--redis", help="Replicate over this Redis (redis://...) instead of the TCP hub.")
@click.option("--no-spark", is_flag=True, help="Skip the Spark export at the end.")
@click.option("--keep", is_flag=True, help="Keep the run's folder (logs, export) after success.")
def demo(
    duration: float, dsn: str | None, schema: str, redis: str | None, no_spark: bool, keep: bool
) -> None:
    """The reference chat service end to end: its processes, simulated users, a live
    dashboard, then the Spark export of `events` to Parquet. Exits 1 if a check fails."""
    import asyncio

    from plait.demo.run import demo as run_demo

    console = _console()
    _stop_on_sigterm_as_on_ctrl_c()
    try:
        ok = asyncio.run(
            run_demo(
                duration=duration,
                dsn=dsn,
                redis=redis,
                spark=not no_spark,
                console=console,
                keep=keep,
                schema_name=schema,
            )
        )
    except KeyboardInterrupt:
        console.line()
        console.print("stopped: every process of the demo was stopped")
        sys.exit(130)
    sys.exit(0 if ok else 1)


def _stop_on_sigterm_as_on_ctrl_c() -> None:
    """SIGTERM (`kill`, `timeout`, a service manager) stops the command as Ctrl-C does,
    through its clean-up: by default it ended Python at once, and the servers and
    processes the command had started ran on without it.

    A command started in the background by a script (`plait check &`, no job control)
    inherits SIGINT ignored, as shells do for background jobs; Python then leaves it
    ignored and asyncio installs no Ctrl-C handler, so SIGTERM, passed on as SIGINT,
    did nothing and the command ran on. SIGINT is handled again here."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))


F = TypeVar("F", bound=Callable[..., Any])


def _count(name: str, default: int, help: str) -> Callable[[F], F]:
    return click.option(
        name, type=click.IntRange(min=1), default=default, show_default=True, help=help
    )


@main.command()
@click.option(
    "--dsn",
    envvar="PLAIT_DSN",
    help="PostgreSQL to use (or $PLAIT_DSN); default: a server of the checker's own (the"
    " embedded one, in a new directory, removed at the end), which it restarts and crashes"
    " as faults. A server given here is never restarted.",
)
@click.option(
    "--pg-faults/--no-pg-faults",
    default=None,
    help="PostgreSQL restarts (fast shutdown, then start) and crashes (kill -9 of the"
    " postmaster, then start) among the faults. Default: on with the checker's own server,"
    " off with --dsn; --pg-faults with --dsn is refused, since the checker restarts only a"
    " server it started.",
)
@click.option(
    "--kind",
    "kinds",
    multiple=True,
    type=click.Choice(FAULT_KINDS),
    help="Only this fault kind (repeat for several); default: every kind the run can have.",
)
@click.option(
    "--transport",
    type=click.Choice(["tcp", "redis"]),
    default=_CHECK.transport,
    show_default=True,
    help="tcp: a hub behind a proxy that cuts connections; redis: a redis-server of its own.",
)
@_count("--writers", _CHECK.writers, "Writer processes.")
@_count("--streams", _CHECK.streams, "Streams, each written by all.")
@click.option(
    "--duration",
    type=_SECONDS,
    default=_CHECK.duration,
    show_default=True,
    help="Seconds of writes and faults.",
)
@_count("--faults", _CHECK.faults, "Faults of each kind.")
@click.option(
    "--long-faults",
    type=click.IntRange(min=1),
    help="Faults of each kind that lasts seconds (PostgreSQL restarts, crashes and"
    " partitions, Spark query restarts). Default: a tenth of --faults (Spark: a quarter),"
    " at least one.",
)
@_count("--batch", _CHECK.batch, "Scales the IDs per transaction.")
@click.option("--seed", type=int, help="Seed of the fault schedule (default: random, printed).")
@click.option(
    "--fence-after",
    type=_SECONDS,
    default=_CHECK.fence_after,
    show_default=True,
    help="The writers' fence_after (seconds).",
)
@click.option(
    "--stall-bound",
    type=_SECONDS,
    default=_CHECK.stall_bound,
    show_default=True,
    help="Longest a linear reader may trail the position the writers allow (seconds).",
)
@click.option(
    "--spark-stall-bound",
    type=_SECONDS,
    default=_CHECK.spark_stall_bound,
    show_default=True,
    help="Longest the Spark reader may trail it (seconds; with --spark).",
)
@click.option(
    "--run-dir",
    type=click.Path(path_type=Path),
    help="Where journals and logs go (kept) [default: a temporary folder, removed when all "
    "is well].",
)
@click.option(
    "--keep", is_flag=True, help="Keep the run's schema and temporary folder when all is well."
)
@click.option(
    "--spark",
    is_flag=True,
    help="Also read every stream with a Spark streaming query (a JVM of its own), and"
    " restart those queries as faults.",
)
@click.option("--json", "as_json", is_flag=True, help="The summary as one JSON line.")
def check(dsn: str | None, as_json: bool, **options: Any) -> None:
    """Run writers and readers of every kind, break them on a schedule (kill -9 and
    restart, SIGSTOP, slow commits, terminated connections, cut transport connections,
    Redis restarts, PostgreSQL restarts and crashes, a writer partitioned from
    PostgreSQL), then check that every committed
    row reached every reader exactly once, nothing else did, nothing went back and
    nothing stalled past the bound. A fault that cannot be injected is counted and tried
    again. Exits 1 on any violation."""
    import asyncio

    from plait.check.run import Checker
    from plait.check.table import summary

    if options["run_dir"] is not None:
        _check_folder(str(options["run_dir"]), "--run-dir")
    console = _console()
    if dsn and options["pg_faults"]:
        raise click.UsageError(
            "--pg-faults restarts and kill -9s PostgreSQL, which the checker does only to a"
            " server it started: leave out --dsn (and unset $PLAIT_DSN) to let it start its"
            " own, or leave out --pg-faults"
        )
    options["kinds"] = tuple(options["kinds"]) or None
    try:
        checker = Checker(_CHECK(dsn=dsn or None, **options))
    except ConfigError as err:
        raise click.UsageError(str(err)) from None
    _stop_on_sigterm_as_on_ctrl_c()
    try:
        report = asyncio.run(checker.run(None if as_json else console.print))
    except KeyboardInterrupt:
        console.line()
        where = f"; journals and logs: {checker.run_dir}" if checker.run_dir else ""
        console.print(f"stopped: every process and server of the check was stopped{where}")
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(report.to_json()))
    else:
        for table in summary(report):
            console.print(table)
        for problem in report.problems:
            console.print(f"[red]{problem}[/red]")
        if report.run_dir_kept:
            console.print(f"journals and logs: {report.run_dir}")
    sys.exit(0 if report.ok else 1)


@main.command()
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="The instance's YAML configuration (docs: Configuration).",
)
@click.option("--instance-name", help="Overrides the file's instance_name.")
@click.option("--dsn", envvar="PLAIT_DSN", help="Overrides the file's database (or $PLAIT_DSN).")
@click.option(
    "--app",
    metavar="MODULE:FUNCTION",
    help="Called with the Instance before it starts, to register the application's "
    "handlers; it may return an async function to run once the instance is up.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one JSON object per line (time, level, logger, message, instance, stream).",
)
def serve(
    config_path: str,
    instance_name: str | None,
    dsn: str | None,
    app: str | None,
    log_level: str,
    log_format: str,
) -> None:
    """Run one instance from its configuration until Ctrl-C or SIGTERM, then stop
    gracefully (pending rows sent, departure announced)."""
    import asyncio
    import logging

    from rich.console import Console
    from rich.logging import RichHandler

    from plait.config import InstanceConfig
    from plait.ops.serve import load_app, serve

    overrides: dict[str, Any] = {}
    if instance_name:
        overrides["instance_name"] = instance_name
    if dsn:
        overrides["database"] = dsn
    config = InstanceConfig.from_yaml(config_path, **overrides)
    application = load_app(app) if app else None
    if log_format == "json":
        from plait.ops.log_format import JsonLines

        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonLines(config.instance_name))
    elif sys.stderr.isatty():
        console = Console(stderr=True)
        handler = RichHandler(console=console, show_path=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:  # a log file or a pipe: one plain line per record
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=log_level.upper(), handlers=[handler], force=True)
    asyncio.run(serve(config, application))


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
    from plait.storage.database import connect_or_say
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
    ) -> tuple[list[ops.StreamRows], list[ops.StreamStatus], dict[str, str]]:
        pending, failed = ops.scrape(instances)
        streams = ops.read(conn)
        return streams, [ops.assess(s, stall_after, pending) for s in streams], failed

    with _database(dsn, schema) as url, connect_or_say(url, autocommit=True) as conn:
        ops.check_schema(conn)
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
            return found, failed, ops.rows_written(conn, streams, ops.positions(before or []))

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
    from plait.storage.database import connect_or_say
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


class _Printer(contextlib.AbstractContextManager[Any]):
    """`rich.live.Live`'s `update` for output that is not a terminal: print, flushed."""

    def __init__(self, console: Any) -> None:
        self._console = console

    def update(self, renderable: Any, *, refresh: bool = False) -> None:
        self._console.print(renderable)
        self._console.file.flush()

    def __exit__(self, *exc: object) -> None:
        return None


def _say(text: str) -> None:
    """A line about the command itself (not its output), to stderr."""
    click.echo(text, err=True)


def _console() -> Any:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a file or a pipe: whole numbers, not 80 columns' worth
        console = Console(width=160)
    return console


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


def _check_before_spark(options: dict[str, Any], columns: dict[str, str | None]) -> None:
    """What Spark would otherwise find wrong tens of seconds into its JVM, or after
    creating something: the database, the stream, --table, the stream's columns that
    `columns` names by flag, --starting-token, and that --path and --checkpoint can be
    folders. Checked first, in under a second, and refused in the flag's name."""
    from plait.spark import catalog

    if options["master"] and options["remote"]:
        raise click.BadParameter(
            f"give --master or --remote, not both (--remote {options['remote']!r} "
            "may come from $SPARK_REMOTE)",
            param_hint="'--master'",
        )
    if options["remote"]:
        from plait.spark.session import connect_address

        try:
            connect_address(options["remote"])
        except ConfigError as err:
            raise click.BadParameter(str(err), param_hint="'--remote'") from None
    from plait.spark.options import trigger_rows_conflict

    most, least = options["max_rows_per_trigger"], options["min_rows_per_trigger"]
    if why := trigger_rows_conflict(least, most):
        raise click.BadParameter(
            f"{least} is above --max-rows-per-trigger {most}: {why}",
            param_hint="'--min-rows-per-trigger'",
        )
    if options["max_trigger_delay"] is not None and least is None:
        raise click.BadParameter(
            "it bounds how long a batch waits for --min-rows-per-trigger rows, and does "
            "nothing without that flag",
            param_hint="'--max-trigger-delay'",
        )
    for flag in ("--path", "--checkpoint"):
        folder = options.get(flag.removeprefix("--"))
        if folder and options["remote"] and "://" not in folder and not Path(folder).is_absolute():
            raise click.BadParameter(
                f"{folder!r} is relative: over --remote the server writes it, from its own "
                "working folder; give an absolute path or a URI",
                param_hint=f"'{flag}'",
            )
        if folder:
            _check_folder(folder, flag)
    with catalog.connect(options["dsn"]) as conn:
        spec = catalog.load_spec(conn, options["stream"])
        try:
            table = catalog.pick_table(spec, options["table"])
        except ConfigError as err:
            reason = str(err).removeprefix("plait source: ")
            raise click.BadParameter(reason, param_hint="'--table'") from None
        names = [column.name for column in catalog.columns(conn, table)]
        for flag, column in columns.items():
            if column is not None and column not in names:
                raise click.BadParameter(
                    f"stream {spec.name!r} (table {table.name!r}) has no column {column!r}; "
                    f"its columns: {', '.join(names)}",
                    param_hint=f"'{flag}'",
                )
        value = options["starting_token"]
        try:
            catalog.parse_token(spec, value, catalog.OnConnection(conn))
        except catalog.Refused as err:
            raise click.BadParameter(
                f"{err}; {catalog.FOREIGN_TOKEN}", param_hint="'--starting-token'"
            ) from None
        except ValueError as err:  # worded for the Spark source, which the flag feeds
            reason = str(err).removeprefix("plait source: ")
            raise click.BadParameter(reason, param_hint="'--starting-token'") from None


def _check_folder(folder: str, flag: str) -> None:
    """A local folder that is one already or can be made: not a file, nor under one."""
    if "://" in folder:
        return  # another file system's: Spark's to reach
    path = Path(folder).absolute()
    for place in (path, *path.parents):
        if place.is_dir():
            return
        if place.exists():
            what = "is a file" if place == path else f"is under {str(place)!r}, a file"
            raise click.BadParameter(f"{folder!r} {what}, not a folder", param_hint=f"'{flag}'")


def _source(options: dict[str, Any]) -> Any:
    from plait.spark.pipelines import Source

    return Source(
        dsn=options["dsn"],
        stream=options["stream"],
        table=options["table"],
        starting=options["starting_token"],
        max_rows=options["max_rows_per_trigger"],
        min_rows=options["min_rows_per_trigger"],
        max_delay=options["max_trigger_delay"],
    )


def _spark(options: dict[str, Any]) -> tuple[Any, Callable[[], None], Any]:
    """The session --master or --remote names, with --conf's settings, printing each
    batch's progress; and what stops it."""
    from plait.spark.pipelines import progress_printer
    from plait.spark.session import quiet_session

    master, remote = options["master"], options["remote"]
    spark = quiet_session("plait", master=master or "local[*]", conf=options["conf"], remote=remote)
    printer = progress_printer(spark)

    def stop() -> None:
        if remote:
            # A Connect listener lives in this client: removing it waits for its last
            # events; after stop() it could not be removed (a warning at exit).
            spark.streams.removeListener(printer)
        spark.stop()  # a classic session's listener hears its last events first

    return spark, stop, printer


def _ran(ended: bool, options: dict[str, Any], printer: Any) -> None:
    """After a pipeline: a --once run that ended by itself and read no row says so (it
    printed nothing at all before)."""
    if ended and options["once"] and printer.rows == 0:
        click.echo(
            "nothing new: the stream has no rows past where the checkpoint ends",
            err=True,
        )


def unreachable(err: DatabaseUnavailableError) -> str:
    """The command line's one message for a PostgreSQL it could not connect to, whatever
    the command (the library's own speaks of `dsn=None` and `Database.connect`)."""
    if isinstance(err, InvalidDsnError):
        return (
            f"{err.reason}. Give --dsn a URI such as postgresql://user@host:5432/dbname, or "
            "leave it out to use the embedded server"
        )
    waited = f" (waited {err.waited:.0f} s)" if err.waited else ""
    return (
        f"cannot connect to PostgreSQL at {err.server}{waited}: {err.reason}. Check that it "
        "runs there and the user, password and database name; without --dsn (or "
        "`database` in the configuration file) plait uses its embedded server"
    )


def _warnings_to_stderr() -> None:
    """plait's warnings (a missing index, a server it waits for) on stderr, one line
    each, as Python's last-resort handler showed them before the library's logger got its
    NullHandler; `plait serve` sets up its own."""
    import logging

    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.WARNING)


def run() -> None:
    """Entry point: plait's own errors as one line, exit status 2."""
    _warnings_to_stderr()
    try:
        main(standalone_mode=False, prog_name="plait")
    except click.exceptions.Abort:
        sys.exit(130)
    except SystemExit as err:
        # Click ends a command with status 1 on any EPIPE, once it has quieted the
        # streams. For a command whose output is its data, read by a pipe that closed
        # (`plait tail ... | head`), the reader got what it wanted: not an error. For
        # any other (a socket of `serve`), it stays one.
        piped = sys.argv[1:2] in (["tail"], ["status"])
        if err.code == 1 and piped and isinstance(sys.stdout, click.utils.PacifyFlushWrapper):
            sys.exit(0)
        raise
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except DatabaseUnavailableError as err:
        click.echo(f"plait: {unreachable(err) if err.server else err}", err=True)
        sys.exit(2)
    except (PlaitError, RuntimeError) as err:
        # The Spark source names itself for users of Spark; here the command says it.
        click.echo(f"plait: {str(err).removeprefix('plait source: ')}", err=True)
        sys.exit(2)
    except Exception as err:
        import psycopg

        if not isinstance(err, psycopg.Error):
            raise
        from plait.core.redact import redact

        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        # libpq quotes a DSN it cannot parse back, password and all.
        click.echo(f"plait: database error: {redact(first)}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    run()
