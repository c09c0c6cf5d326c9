"""What any command-line tool does: `--version`, `python -m plait`, a bare `plait` that
shows its help (exit 0), and output into a pipe that closes early (`| head`) ending
quietly with status 0. Run as a user runs them: the installed script, in a process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import pace
from plait import Database
from stream_helpers import create_generator, create_table

PLAIT = str(Path(sys.executable).parent / "plait")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return pace.run(args, 60, capture_output=True, text=True)


def test_version_module_and_bare_command() -> None:
    shown = _run(PLAIT, "--version")
    assert (shown.returncode, shown.stdout.strip()) == (0, f"plait {version('plait')}")
    module = _run(sys.executable, "-m", "plait", "--help")
    assert module.returncode == 0, module.stderr
    assert module.stdout.startswith("Usage: plait ")
    bare = _run(PLAIT)
    assert bare.returncode == 0, bare.stderr
    assert "Commands:" in bare.stdout
    assert bare.stderr == ""


async def test_tail_into_a_pipe_that_closes_early_ends_with_status_0(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    try:
        await gen.insert(
            "INSERT INTO events SELECT {id}, 'w', repeat('x', 100) FROM generate_series(1, %s)"
            " RETURNING stream_id",
            (3000,),  # some 500 kB of JSON lines: far more than a pipe holds
        )
        await gen.flush_position()
    finally:
        await gen.close()
    first, status, errors = await asyncio.to_thread(_head_of_tail, db.dsn)
    assert status == 0, errors
    assert b'"token"' in first
    assert errors == ""


def _head_of_tail(dsn: str) -> tuple[bytes, int, str]:
    """`plait tail events | head -1`: the first line, tail's status and its stderr."""
    process = subprocess.Popen(
        [PLAIT, "tail", "events", "--dsn", dsn, "-n", "3000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    first = process.stdout.readline()
    process.stdout.close()  # what `head -1` does
    errors = process.stderr.read().decode()
    return first, process.wait(timeout=pace.scaled(60)), errors  # TimeoutExpired names it


STREAM_SETUP = """
import asyncio
from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec
from plait.storage.search_path import in_schema


async def main() -> None:
    server = await Database.connect(None, min_size=1, max_size=1)  # the embedded one
    async with server.connection() as conn:
        await conn.execute("CREATE SCHEMA IF NOT EXISTS mine")
    # `server` holds the embedded server (its last user stops it), `db` works in "mine".
    db = await Database.connect(in_schema(server.dsn, "mine"), min_size=1, max_size=2)
    await db.migrate()
    async with db.connection() as conn:
        await conn.execute(
            "CREATE TABLE events (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL);"
            " CREATE INDEX ON events (instance_name, stream_id)"
        )
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=["w"])
    gen = await MultiWriterIdGenerator.create(db, spec, "w")
    await gen.insert(
        "INSERT INTO events SELECT {id}, 'w' FROM generate_series(1, 25) RETURNING stream_id"
    )
    await gen.close()
    await db.close()
    await server.close()


asyncio.run(main())
"""


@pytest.mark.slow
def test_export_without_dsn_reads_the_embedded_server_in_the_schema_given(
    tmp_path: Path,
) -> None:
    """As every other command: no --dsn, plait's embedded server (here one of the test's
    own, $PLAIT_DATA_DIR), in --schema."""
    env = {**os.environ, "PLAIT_DATA_DIR": str(tmp_path / "data")}
    env.pop("PLAIT_DSN", None)
    try:
        made = subprocess.run(
            [sys.executable, "-c", STREAM_SETUP], env=env, capture_output=True, text=True
        )
        assert made.returncode == 0, made.stderr[-3000:]
        out = tmp_path / "out"
        export = [
            PLAIT, "export", "--schema", "mine", "--stream", "events", "--path", str(out),
            "--checkpoint", str(tmp_path / "ck"), "--once",
        ]  # fmt: skip
        done = pace.run(export, 300, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        import pyarrow.parquet as pq

        assert pq.read_table(out).num_rows == 25
    finally:
        from plait.storage import embedded

        embedded.stop(tmp_path / "data" / "postgres")
