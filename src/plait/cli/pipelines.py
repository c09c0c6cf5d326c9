"""`plait export` and `plait derive`: the Spark pipelines, exactly once across restarts
through their `--checkpoint` folder. Everything a user can get wrong is checked before
Spark starts."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from plait.cli.common import (
    _DSN,
    _SCHEMA,
    _STREAM,
    _database,
    _duration_flag,
    _spark_conf,
    check_folder,
)
from plait.cli.group import main
from plait.errors import ConfigError


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


def _check_before_spark(options: dict[str, Any], columns: dict[str, str | None]) -> None:
    """What Spark would otherwise find wrong tens of seconds into its JVM, or after
    creating something: the database, the stream, --table, the stream's columns that
    `columns` names by flag, --starting-token, and that --path and --checkpoint can be
    folders. Checked first, in under a second, and refused in the flag's name."""
    from plait.storage import catalog

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
            check_folder(folder, flag)
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
