"""Commands that run something until it ends: `demo`, `check` and `serve`."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click

from plait.check.options import Options as _CHECK  # its defaults are the command's
from plait.check.plan import FAULT_KINDS
from plait.cli.common import _ANY_DSN, _SECONDS, _console, _count, check_folder
from plait.cli.group import main
from plait.demo import SCHEMA as DEMO_SCHEMA
from plait.errors import ConfigError


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
        check_folder(str(options["run_dir"]), "--run-dir")
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
    "handlers; it may return an async function to run once the instance is up. The "
    "module is looked for in the working directory first.",
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
