"""Bad input gets one clear error naming the problem and the fix, and corrupts nothing."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from psycopg import sql

import pace
from plait import (
    ConfigError,
    Database,
    DatabaseUnavailableError,
    InvalidDsnError,
    MultiWriterIdGenerator,
    SchemaError,
    SequenceBehindError,
    StreamSpec,
    StreamToken,
    TableSpec,
    TokenParseError,
)
from plait.cli import main, unreachable
from plait.ports import free_port
from stream_helpers import create_generator, create_table, insert_rows, stored_positions


async def test_wrong_dsn_is_one_clear_error() -> None:
    with pytest.raises(DatabaseUnavailableError, match="could not connect to PostgreSQL at"):
        await Database.connect("postgresql://nobody:secret@127.0.0.1:1/none")
    with pytest.raises(DatabaseUnavailableError) as info:
        await Database.connect("postgresql://nobody:secret@127.0.0.1:1/none")
    assert "secret" not in str(info.value)
    with pytest.raises(InvalidDsnError, match="invalid DSN") as bad:
        await Database.connect("host=127.0.0.1 bogus_option=1")
    assert isinstance(bad.value, ConfigError)  # a mistake in the configuration
    assert isinstance(bad.value, DatabaseUnavailableError)  # and no database reached


def test_a_malformed_dsn_on_the_command_line_says_what_to_give_instead() -> None:
    """Told apart by its type, not by the words of libpq's message: every command says
    what --dsn takes, whatever the reason libpq gives."""
    for dsn in ["host=127.0.0.1 bogus_option=1", "postgresql://u@h:notaport/db", "a=b=c"]:
        for args in (["status", "--dsn", dsn], ["tail", "events", "--dsn", dsn]):
            result = CliRunner().invoke(main, args)
            assert isinstance(result.exception, InvalidDsnError), (args, result.output)
            message = unreachable(result.exception)
            assert message.startswith("invalid DSN"), message
            assert "Give --dsn a URI such as postgresql://" in message
            assert "dsn=None" not in message


def test_where_the_server_is_said_with_what_libpq_takes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DSN that leaves host, port or database out reaches the server PGHOST, PGPORT
    and PGDATABASE name, and the errors say that one, not localhost:5432."""
    from plait.storage.server_errors import server_address

    monkeypatch.setenv("PGHOST", "db.example")
    monkeypatch.setenv("PGPORT", "6543")
    monkeypatch.setenv("PGDATABASE", "shop")
    assert server_address("") == "db.example:6543/shop"
    assert server_address("user=app") == "db.example:6543/shop"
    assert server_address("postgresql://other:5000/x") == "other:5000/x"
    monkeypatch.delenv("PGDATABASE")
    monkeypatch.setenv("PGUSER", "app")
    assert server_address("host=h") == "h:6543/app"  # libpq's database is the user's name


def test_every_command_says_the_same_about_a_database_it_cannot_reach() -> None:
    """One message whatever the command: where (host, port, database), why, what to check,
    and that without --dsn the embedded server is used; no password, no Python API."""
    dsn = "postgresql://nobody:secret@127.0.0.1:1/none"
    out = ["--path", "/tmp/plait-never", "--checkpoint", "/tmp/plait-never-ck", "--once"]
    derived = ["--checkpoint", "/tmp/plait-never-ck", "--target-table", "t", "--key", "k"]
    commands = [
        ["status", "--dsn", dsn],
        ["tail", "events", "--dsn", dsn],
        ["migrate", "--dsn", dsn],
        ["export", "--dsn", dsn, "--stream", "events", *out],
        ["derive", "--dsn", dsn, "--stream", "events", *derived, "--once"],
    ]
    said = set()
    for args in commands:
        result = CliRunner().invoke(main, args)
        assert isinstance(result.exception, DatabaseUnavailableError), (args, result.output)
        said.add(unreachable(result.exception))
    (message,) = said
    assert message.startswith("cannot connect to PostgreSQL at 127.0.0.1:1/none: ")
    assert "Connection refused" in message
    assert "without --dsn" in message
    assert "secret" not in message
    assert "dsn=None" not in message
    assert "\t" not in message


async def test_missing_database_name(server_dsn: str) -> None:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(server_dsn)
    params["dbname"] = "plait_no_such_database"
    with pytest.raises(DatabaseUnavailableError, match="plait_no_such_database"):
        await Database.connect(make_conninfo("", **params))


async def test_missing_table(db: Database) -> None:
    with pytest.raises(SchemaError, match="table 'events' does not exist"):
        await create_generator(db, ["w"], "w")


async def test_missing_column(db: Database) -> None:
    await create_table(db)
    spec = StreamSpec("events", tables=[TableSpec("events", id_column="ordering")], writers=["w"])
    with pytest.raises(SchemaError, match="has no column 'ordering'"):
        await MultiWriterIdGenerator.create(db, spec, "w")


async def test_wrong_column_type(db: Database) -> None:
    async with db.connection() as conn:
        await conn.execute("CREATE TABLE events (stream_id TEXT, instance_name TEXT)")
    with pytest.raises(SchemaError, match=r"events.stream_id is text, but plait needs BIGINT"):
        await create_generator(db, ["w"], "w")


async def test_positions_ahead_of_sequence_refuse_to_start(db: Database) -> None:
    await create_table(db)
    await insert_rows(db, "w", 5)
    async with db.connection() as conn:
        await conn.execute("SELECT setval('events_seq', 10)")
        await conn.execute("UPDATE stream_positions SET stream_id = 12 WHERE instance_name = 'w'")
    with pytest.raises(SequenceBehindError) as info:
        await create_generator(db, ["w"], "w")
    message = str(info.value)
    assert "DELETE FROM stream_positions WHERE stream_name = 'events'" in message
    assert "stop every writer" in message
    assert await stored_positions(db) == {"w": 12}  # nothing was changed


async def test_bad_specs() -> None:
    with pytest.raises(ConfigError, match="at least one table"):
        StreamSpec("s", tables=[])
    with pytest.raises(ConfigError, match="not a valid SQL"):
        StreamSpec("s", tables=[TableSpec("bad name")])
    with pytest.raises(ConfigError, match="writers must be a list"):
        StreamSpec("s", tables=[TableSpec("t")], writers="first")  # a str passes as a Sequence[str]
    with pytest.raises(ConfigError, match="lists a writer twice"):
        StreamSpec("s", tables=[TableSpec("t")], writers=["a", "a"])
    with pytest.raises(ConfigError, match="must differ"):
        TableSpec("t", id_column="x", instance_column="x")


async def test_bad_arguments(db: Database) -> None:
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    with pytest.raises(ConfigError):
        gen.get_next_mult(0)
    with pytest.raises(ConfigError):
        gen.advance("other", "7")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        await gen.get_updates_since("w", 0, 5, limit=0)
    with pytest.raises(ConfigError, match="instance_name"):
        await MultiWriterIdGenerator.create(db, gen.spec, "")
    assert gen.get_positions() == {"w": 1}


async def test_malformed_tokens(db: Database) -> None:
    for text in ("", "s", "x5", "m5~1", "s-3", "m5~1.9~1.8", "s5 "):
        with pytest.raises(TokenParseError):
            await StreamToken.parse(db, text)
    with pytest.raises(TokenParseError, match="instance id 999"):
        await StreamToken.parse(db, "m1~999.5")


async def test_case_sensitive_identifiers_are_quoted(db: Database) -> None:
    async with db.connection() as conn:
        await conn.execute(
            sql.SQL(
                'CREATE TABLE "Mixed" ("Id" BIGINT NOT NULL, "Who" TEXT NOT NULL);'
                ' CREATE INDEX ON "Mixed" ("Who", "Id")'
            )
        )
    spec = StreamSpec(
        "mixed",
        sequence="Mixed_Seq",
        tables=[TableSpec("Mixed", id_column="Id", instance_column="Who")],
        writers=["w"],
    )
    gen = await MultiWriterIdGenerator.create(db, spec, "w")
    async with gen.get_next() as stream_id:
        assert stream_id == 2


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["demo", "--duration", "-5", "--no-spark"], "'--duration'"),
        (["check", "--duration", "0"], "'--duration'"),
        (["check", "--fence-after", "-1"], "'--fence-after'"),
        (["check", "--stall-bound", "soon"], "'--stall-bound'"),
        (["check", "--writers", "0"], "'--writers'"),
        (["status", "--dsn", "x", "--watch", "--every", "0"], "'--every'"),
        (["status", "--dsn", "x", "--stall-after", "-3"], "'--stall-after'"),
        (["tail", "events", "--dsn", "x", "-n", "-3"], "'-n' / '--lines'"),
        (["tail", "events", "--dsn", "x", "-f", "--every", "0"], "'--every'"),
        (
            [
                "export",
                "--dsn",
                "x",
                "--stream",
                "s",
                "--path",
                "p",
                "--checkpoint",
                "c",
                "--max-rows-per-trigger",
                "0",
            ],
            "'--max-rows-per-trigger'",
        ),
        (
            [
                *("derive", "--dsn", "x", "--stream", "s", "--checkpoint", "c"),
                *("--target-table", "t", "--key", "k", "--conf", "spark.executor.memory"),
            ],
            "'--conf'",
        ),
    ],
)
def test_a_mistyped_flag_is_refused_by_its_name_before_anything_runs(
    args: list[str], flag: str
) -> None:
    """A zero or negative duration ran (`check --duration -3` printed "running -3 s" and
    went on; `--every 0` polled without pause): refused now, naming the flag."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for {flag}" in result.output


async def test_spark_commands_check_their_flags_before_spark_starts(
    db: Database, tmp_path: Path
) -> None:
    """`plait export`/`derive` with a mistake Spark would find only tens of seconds
    into its JVM (or after creating the target table): refused first, naming the flag,
    and nothing is created."""
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    await gen.close()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    base = ["--dsn", db.dsn, "--stream", "events", "--once"]
    out = ["--path", str(tmp_path / "out"), "--checkpoint", str(tmp_path / "ck")]
    derive = ["derive", *base, "--checkpoint", str(tmp_path / "c"), "--target-table", "kept"]
    cases = [
        (["export", *base, *out, "--table", "nosuch"], "'--table'", "has no table 'nosuch'"),
        (["export", *base, *out, "--partition-by", "room"], "'--partition-by'", "no column 'room'"),
        (
            ["export", *base, *out, "--partition-by-date", "at"],
            "'--partition-by-date'",
            "has no column 'at'; its columns: stream_id, instance_name, payload",
        ),
        (
            ["export", *base, "--path", str(a_file / "out"), "--checkpoint", str(tmp_path / "c")],
            "'--path'",
            "a file, not a folder",
        ),
        (
            ["export", *base, "--path", str(tmp_path / "o"), "--checkpoint", str(a_file)],
            "'--checkpoint'",
            "is a file",
        ),
        (
            [*derive, "--key", "nosuchcol"],
            "'--key'",
            "has no column 'nosuchcol'",
        ),
        (
            [*derive, "--key", "instance_name", "--kind", "counts", "--time-column", "when"],
            "'--time-column'",
            "has no column 'when'",
        ),
        (
            ["export", *base, *out, "--min-rows-per-trigger", "10", "--max-rows-per-trigger", "5"],
            "'--min-rows-per-trigger'",
            "10 is above --max-rows-per-trigger 5",
        ),
        (
            ["export", *base, *out, "--max-trigger-delay", "30s"],
            "'--max-trigger-delay'",
            "does nothing without that flag",
        ),
        (
            ["export", *base, *out, "--min-rows-per-trigger", "9", "--max-trigger-delay", "9x"],
            "'--max-trigger-delay'",
            "must be a duration such as 500ms, 30s, 15m or 1h, not '9x'",
        ),
        (["export", *base, *out, "--remote", "http://x"], "'--remote'", "is no Spark Connect URL"),
        (
            ["export", *base, *out, "--remote", "sc://h:1", "--master", "local[2]"],
            "'--master'",
            "give --master or --remote, not both",
        ),
        (
            ["export", *base, "--remote", "sc://h:1", "--path", "rel", "--checkpoint", "/tmp/c"],
            "'--path'",
            "'rel' is relative: over --remote the server writes it",
        ),
    ]
    for args, flag, reason in cases:
        result = await asyncio.to_thread(CliRunner().invoke, main, args)
        assert result.exit_code == 2, (args, result.output)
        assert f"Invalid value for {flag}" in result.output, result.output
        assert reason in result.output, result.output
    async with db.connection() as conn:
        cur = await conn.execute("SELECT to_regclass('kept')")
        assert await cur.fetchone() == (None,)  # derive created nothing
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "ck").exists()


async def test_an_unreachable_spark_connect_server_is_one_line_within_seconds(
    db: Database, tmp_path: Path
) -> None:
    """`--remote` to a port nobody listens on: one line naming host and port, at once
    (PySpark's client would retry for minutes)."""
    await create_table(db)
    gen = await create_generator(db, ["w"], "w")
    await gen.close()
    port = free_port()
    args = [
        "export", "--dsn", db.dsn, "--stream", "events", "--once",
        "--remote", f"sc://127.0.0.1:{port}",
        "--path", str(tmp_path / "o"), "--checkpoint", str(tmp_path / "c"),
    ]  # fmt: skip
    result = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert isinstance(result.exception, ConfigError), result.output
    assert f"cannot reach the Spark Connect server at 127.0.0.1:{port}" in str(result.exception)


def test_a_schema_that_is_no_plain_name_is_refused_by_its_flag() -> None:
    result = CliRunner().invoke(
        main, ["status", "--dsn", "postgresql://x@127.0.0.1:1/y", "--schema", "a b"]
    )
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception).startswith("--schema 'a b' is not a plain schema name")


async def test_an_instance_listens_where_instance_map_says_and_names_a_taken_address(
    dsn: str,
) -> None:
    """One file for every instance: each listens on its own instance_map entry's port,
    not on the file's http.port; an address in use is one line saying which setting
    named it and which instance it belongs to (it was a 50-line OSError traceback)."""
    from plait.instance import Instance

    ports = {"a": free_port(), "b": free_port()}

    def config(name: str) -> dict[str, object]:
        return {
            "instance_name": name,
            "database": dsn,
            "instance_map": {n: f"http://127.0.0.1:{p}" for n, p in ports.items()},
            "http": {"port": ports["a"]},  # the file's, right for a only
        }

    async with Instance(config("a")) as a, Instance(config("b")) as b:
        assert a.http_url == f"http://127.0.0.1:{ports['a']}"
        assert b.http_url == f"http://127.0.0.1:{ports['b']}"
        # c has no entry: the file's http.port, which a holds.
        with pytest.raises(ConfigError) as err:
            async with Instance(config("c")):
                pass
    assert str(err.value) == (
        f"instance 'c' cannot listen on 127.0.0.1:{ports['a']} (http.port): the address is "
        "in use; instance_map gives it to a. Does this instance run already? Else give each "
        "instance its own address in instance_map (the file's http.port is the same for all)"
    )


async def test_the_demo_drops_no_schema_it_did_not_make(server_dsn: str) -> None:
    """`plait demo --schema` drops its schema at every run: an existing one that the demo
    did not make (an application's) is refused by the flag, and left as it was."""
    import psycopg

    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS not_the_demos CASCADE; CREATE SCHEMA not_the_demos")
        conn.execute("CREATE TABLE not_the_demos.precious (x int)")
    try:
        args = ["demo", "--dsn", server_dsn, "--schema", "not_the_demos", "--no-spark"]
        done = await asyncio.to_thread(
            pace.run, [sys.executable, "-m", "plait", *args], 120, capture_output=True, text=True
        )
        assert done.returncode == 2, done.stderr
        assert "--schema 'not_the_demos' exists and plait demo did not make it" in done.stderr
        with psycopg.connect(server_dsn) as conn:
            assert conn.execute("SELECT to_regclass('not_the_demos.precious')").fetchone() == (
                "not_the_demos.precious",
            )
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute("DROP SCHEMA IF EXISTS not_the_demos CASCADE")
