"""The `plait` command line. Spark pipelines so far (`plait export`, `plait derive`);
each is exactly once across restarts through its `--checkpoint` folder: run the same
command again and it goes on where it stopped."""

from __future__ import annotations

import sys
from typing import Any

import click

from plait.errors import PlaitError

_DSN = click.option(
    "--dsn",
    envvar="PLAIT_DSN",
    required=True,
    help="PostgreSQL the stream lives in (or $PLAIT_DSN).",
)
_STREAM = click.option("--stream", required=True, help="The plait stream to read.")


def _source_options(command: Any) -> Any:
    for option in reversed(
        [
            _DSN,
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
            click.option("--master", default="local[*]", show_default=True, help="Spark master."),
        ]
    ):
        command = option(command)
    return command


@click.group()
def main() -> None:
    """plait: multi-writer ordered streams on PostgreSQL."""


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
    from plait.spark import pipelines

    spark = _spark(options["master"])
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
    pipelines.run(query, on_stop=spark.stop)


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
    from plait.spark import pipelines

    spark = _spark(options["master"])
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
    pipelines.run(query, on_stop=spark.stop)


def _source(options: dict[str, Any]) -> Any:
    from plait.spark.pipelines import Source

    return Source(
        dsn=options["dsn"],
        stream=options["stream"],
        table=options["table"],
        starting=options["starting_token"],
        max_rows=options["max_rows_per_trigger"],
    )


def _spark(master: str) -> Any:
    from plait.spark.pipelines import progress_printer
    from plait.spark.session import quiet_session

    spark = quiet_session("plait", master=master)
    progress_printer(spark)
    return spark


def run() -> None:
    """Entry point: plait's own errors as one line, exit status 2."""
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except (PlaitError, RuntimeError) as err:
        click.echo(f"plait: {err}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    run()
