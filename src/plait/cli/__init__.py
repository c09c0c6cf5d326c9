"""The `plait` command line: the operator's commands (`status`, `tail`, `migrate`,
`serve`) and the Spark pipelines (`export`, `derive`), each exactly once across restarts
through its `--checkpoint` folder: run the same command again and it goes on where it
stopped. Commands that take `--dsn` without requiring it use plait's embedded
PostgreSQL when none is given, as the library does."""

from __future__ import annotations

import sys

import click

from plait.cli import operations, pipelines, runs  # noqa: F401 - their commands join `main`
from plait.cli.common import _warnings_to_stderr, unreachable
from plait.cli.group import main
from plait.errors import DatabaseUnavailableError, PlaitError


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


__all__ = ["main", "run", "unreachable"]
