"""What the commands share: their common flags, the one message for a database that
cannot be reached, and how output reaches the terminal."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click

from plait.errors import DatabaseUnavailableError, InvalidDsnError
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


F = TypeVar("F", bound=Callable[..., Any])


def _count(name: str, default: int, help: str) -> Callable[[F], F]:
    return click.option(
        name, type=click.IntRange(min=1), default=default, show_default=True, help=help
    )


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


def check_folder(folder: str, flag: str) -> None:
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
