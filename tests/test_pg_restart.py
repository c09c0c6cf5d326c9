"""PostgreSQL restarts and crashes heal without an operator (R-OP-5), for the readers
that follow the database and for the cache worker: each reconnects with backoff and
resumes, and none hangs. The checker's own processes are the readers, run against a
server the test owns: a fast restart (every backend ends with `AdminShutdown`), and a
kill -9 of the postmaster followed by a start.

Before: a database-only reader (`dblinear`) and the `linear` reader raised
`AdminShutdown` out of their loop, then never exited (a psycopg-pool worker swallowed
the shutdown's cancellation and waited forever), and the cache worker's serving task
died on its first failed load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

import pytest

import pace
from pg_restarts import RestartablePostgres, Role, control, prepare_plan, targets
from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec
from plait.check.plan import DB_LINEAR, LINEAR, WORKER
from plait.errors import DatabaseUnavailableError
from plait.instance import Instance
from redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

# A reader of the user's own: a query a tenth of a second, no retry. When PostgreSQL goes
# away the query fails, and the process must end with that error printed.
OWN_READER = """
import asyncio, sys
from plait import Database

async def main() -> None:
    db = await Database.connect(sys.argv[1], max_size=4)
    print("started", flush=True)
    while True:  # a query under way when the server restarts (one idle is replaced)
        async with db.connection() as conn:
            await conn.execute("SELECT pg_sleep(0.5)")

asyncio.run(main())
"""


@pytest.fixture
def pg(restartable_pg: RestartablePostgres) -> RestartablePostgres:
    return restartable_pg


@pytest.mark.parametrize("outage", ["restart", "crash"])
async def test_readers_and_the_cache_worker_resume_after_postgresql_goes_away(
    outage: str, pg: RestartablePostgres, redis_server: RedisServer, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = await prepare_plan(pg.dsn, run_dir, redis_server.url)
    control(plan, phase="run")
    readers = {name: Role(name, name, plan) for name in (LINEAR, DB_LINEAR, WORKER)}
    writer = Role("writer", "w1", plan)
    everyone = [*readers.values(), writer]
    try:
        for reader in readers.values():
            await reader.start()
        await writer.start()
        await asyncio.sleep(1.0)  # rows and invalidations flow
        await asyncio.to_thread(pg.restart if outage == "restart" else pg.crash)
        back = time.time()
        # The writer commits again (it retries its failed transactions) ...
        try:
            await pace.until(
                lambda: any(line.kind == "C" and line.t > back for line in writer.journal()),
                20,
                f"the writer to commit after the {outage}",
                every=0.1,
            )
        except TimeoutError as late:
            raise AssertionError(f"{late}:\n{writer.log_tail()}") from None
        await asyncio.sleep(0.5)
        control(plan, phase="idle")
        await writer.until("idle", 20)
        # ... and every reader reads what it committed after the outage.
        control(plan, phase="idle", targets=await targets(plan))
        for reader in readers.values():
            await reader.until("caught-up", 20)
        control(plan, phase="stop", targets=await targets(plan))
        for process in everyone:
            code = await process.exit_code(20)
            assert code == 0, f"{process.name} exited with {code}:\n{process.log_tail()}"
        worker = readers[WORKER].journal()
        served = [line.fields for line in worker if line.kind == "S" and line.fields[0] == "served"]
        assert served, f"the cache worker's serving task died:\n{readers[WORKER].log_tail()}"
        stale = [line.fields for line in worker if line.kind == "V"]
        assert not stale, f"the cache worker served stale values: {stale[:5]}"
    finally:
        for process in everyone:
            process.kill()


async def test_a_reader_whose_query_fails_in_a_restart_ends_with_the_error_printed(
    pg: RestartablePostgres,
) -> None:
    # Its Database is never closed: the event loop's shutdown must end the pool's tasks.
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        OWN_READER,
        pg.dsn,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        assert process.stderr is not None
        async with pace.within(30, "the reader to say it started"):
            assert await process.stdout.readline() == b"started\n"
        await asyncio.to_thread(pg.restart)
        # Still running after that, it hangs.
        code = await pace.wait(process.wait(), 20, "the reader to end after its query failed")
        stderr = (await process.stderr.read()).decode()
        assert code == 1, stderr
        assert "psycopg.errors.AdminShutdown: terminating connection" in stderr, stderr
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize("outage", ["restart", "crash"])
async def test_after_a_restart_no_statement_fails_on_a_connection_from_before(
    outage: str, pg: RestartablePostgres
) -> None:
    """Connections the pool kept idle through a restart or a crash are found dead
    before use (the server's last words and the end of the stream wait on them) and
    replaced. Before, the first statement after the server came back failed with
    OperationalError (and then the others were tested)."""
    db = await Database.connect(pg.dsn, max_size=6)
    try:

        async def hold() -> None:
            async with db.connection() as conn:
                await conn.execute("SELECT pg_sleep(0.2)")

        await asyncio.gather(*(hold() for _ in range(6)))  # six connections, idle now
        await asyncio.to_thread(pg.restart if outage == "restart" else pg.crash)
        for _ in range(6):
            async with db.connection() as conn:
                await conn.execute("SELECT 1")
        assert db.connections_lost >= 1  # noticed, and counted
    finally:
        await db.close()


@pytest.mark.parametrize("outage", ["restart", "crash"])
async def test_plaits_reads_outlast_a_restart(outage: str, pg: RestartablePostgres) -> None:
    db = await Database.connect(pg.dsn, max_size=4)
    try:

        async def read() -> int:
            async with db.connection() as conn:
                row = await (await conn.execute("SELECT 42")).fetchone()
            assert row is not None
            return int(row[0])

        assert await db.retry_read("the answer", read) == 42
        await asyncio.to_thread(pg.restart if outage == "restart" else pg.crash)
        assert await db.retry_read("the answer", read) == 42
    finally:
        await db.close()


async def test_a_read_gives_up_after_retry_reads_for(pg: RestartablePostgres) -> None:
    db = await Database.connect(pg.dsn, max_size=2, retry_reads_for=1.0)
    try:
        await asyncio.to_thread(pg.stop)

        async def read() -> None:
            async with db.connection() as conn:
                await conn.execute("SELECT 1")

        with pytest.raises(DatabaseUnavailableError, match="could not read the answer"):
            await db.retry_read("the answer", read)
    finally:
        await asyncio.to_thread(pg.start)
        await db.close()


# -- start-up while PostgreSQL is down or restarting -----------------------------------------

EVENTS_DDL = (
    "CREATE TABLE IF NOT EXISTS events (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
    " payload TEXT); CREATE INDEX IF NOT EXISTS events_writer ON events (instance_name, stream_id)"
)
EVENTS = StreamSpec("events", tables=[TableSpec("events")], writers=["w1"])


def _instance(dsn: str, **changes: object) -> Instance:
    instance = Instance(
        {
            "instance_name": "w1",
            "database": dsn,
            "streams": [{"name": "events", "tables": [{"name": "events"}], "writers": ["w1"]}],
            "http": {"enabled": False},
            **changes,
        }
    )
    instance.add_schema(EVENTS_DDL)
    return instance


async def test_an_instance_started_before_postgresql_waits_for_it_and_writes(
    pg: RestartablePostgres, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: `Instance.start()` with the server down failed at once ("could not
    connect"), and a start that met a restart half-way raised psycopg's error."""
    await asyncio.to_thread(pg.stop)
    instance = _instance(pg.dsn, database_patience=90.0)
    try:
        with caplog.at_level(logging.WARNING, logger="plait"):
            starting = asyncio.create_task(instance.start())
            await asyncio.sleep(3.0)
            assert not starting.done(), starting.exception() if starting.done() else None
            await asyncio.to_thread(pg.start)
            await pace.wait(starting, 60, "the instance to start once PostgreSQL did")
        waited = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
        assert waited, [r.getMessage() for r in caplog.records]
        assert f":{pg.port}/" in waited[0], waited  # where it waits for
        gen = instance.generator("events")
        ids = await gen.insert("INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING stream_id")
        assert gen.get_current_token_for_writer("w1") == ids[-1]
    finally:
        await instance.stop()
        await asyncio.to_thread(pg.ensure_running)


async def test_an_instance_whose_postgresql_never_comes_fails_with_plaits_error(
    pg: RestartablePostgres,
) -> None:
    await asyncio.to_thread(pg.stop)
    instance = _instance(pg.dsn, database_patience=2.0)
    started = time.monotonic()
    try:
        with pytest.raises(DatabaseUnavailableError) as failed:
            await instance.start()
        took = time.monotonic() - started
        assert 2.0 <= took < pace.scaled(30), took  # the bound, and not much more
        message = str(failed.value)
        assert f"127.0.0.1:{pg.port}" in message, message
        assert "database_patience" in message, message  # what to do
    finally:
        await instance.stop()
        await asyncio.to_thread(pg.start)


async def test_a_generator_started_during_a_restart_waits_for_the_server(
    pg: RestartablePostgres,
) -> None:
    db = await Database.connect(pg.dsn, max_size=4)
    try:
        await db.migrate()
        await db.run_schema(EVENTS_DDL)
        await asyncio.to_thread(pg.stop)
        starting = asyncio.create_task(MultiWriterIdGenerator.create(db, EVENTS, "w1"))
        await asyncio.sleep(2.0)
        assert not starting.done(), starting.exception() if starting.done() else None
        await asyncio.to_thread(pg.start)
        gen = await pace.wait(starting, 60, "the generator to be made once PostgreSQL started")
        ids = await gen.insert("INSERT INTO events VALUES ({id}, 'w1', 'x') RETURNING stream_id")
        assert ids == [2]
    finally:
        await asyncio.to_thread(pg.ensure_running)
        await db.close()


async def test_a_generator_whose_server_never_comes_back_fails_with_plaits_error(
    pg: RestartablePostgres,
) -> None:
    db = await Database.connect(pg.dsn, max_size=4, retry_reads_for=2.0)
    try:
        await db.migrate()
        await db.run_schema(EVENTS_DDL)
        await asyncio.to_thread(pg.stop)
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailableError, match=f"127.0.0.1:{pg.port}"):
            await MultiWriterIdGenerator.create(db, EVENTS, "w1")
        took = time.monotonic() - started
        assert took < 45, took  # a pool wait (30 s) at most, then the bound
    finally:
        await asyncio.to_thread(pg.start)
        await db.close()


@pytest.mark.parametrize("command", ["tail", "status"])
async def test_tail_follow_and_status_watch_go_on_through_a_restart(
    command: str, pg: RestartablePostgres
) -> None:
    """`plait tail -f` and `plait status --watch`, run as a user runs them: a
    PostgreSQL restart ended both ("database error: terminating connection due to
    administrator command", exit 2). They say they lost the connection, reconnect,
    and go on: tail prints the rows written after the restart, each once."""
    db = await Database.connect(pg.dsn)
    await db.migrate()
    async with db.connection() as conn:
        await conn.execute(
            "CREATE TABLE events (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
            " payload TEXT)"
        )

    async def write(payload: str) -> None:
        gen = await MultiWriterIdGenerator.create(db, EVENTS, "w1")
        await gen.insert(
            "INSERT INTO events VALUES ({id}, 'w1', %s) RETURNING stream_id", (payload,)
        )
        await gen.close()

    await write("before")
    script = Path(sys.executable).parent / "plait"
    args = (
        ["tail", "events", "-f", "--every", "0.1"]
        if command == "tail"
        else ["status", "--watch", "--every", "0.2"]
    )
    process = await asyncio.create_subprocess_exec(
        str(script), *args, "--dsn", pg.dsn,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    assert process.stderr is not None
    try:
        first = await pace.wait(process.stdout.readline(), 60, f"plait {command}'s first line")
        assert first, "it printed nothing before the restart"
        await db.close()
        await asyncio.to_thread(pg.restart)
        lost = await pace.wait(process.stderr.readline(), 60, "a line on the lost connection")
        assert b"lost the connection to PostgreSQL" in lost
        back = await pace.wait(process.stderr.readline(), 60, "a line on the connection back")
        assert b"connected to PostgreSQL at" in back, back
        db = await Database.connect(pg.dsn)
        await write("after")
        if command == "tail":
            line = await pace.wait(process.stdout.readline(), 60, "the row written after")
            assert json.loads(line)["row"]["payload"] == "after"
        else:
            await asyncio.sleep(1)  # a few redraws after the restart
        assert process.returncode is None, "it ended"
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        rest, errors = await process.communicate()
        await db.close()
    if command == "tail":
        assert b'"payload"' not in rest  # no row twice
    assert b"database error" not in errors
