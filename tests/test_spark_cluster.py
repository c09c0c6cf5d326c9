"""The plait source on a Spark standalone cluster (a master and a worker started from the
installed PySpark, `spark_cluster`): the driver, the executor and its Python workers are
separate processes, as on a real cluster, with plait installed in the Python they run
(the cluster route the docs' "Spark on a cluster" describes); and over a Spark Connect
server. Run the way a user runs it: the installed `plait` script, its venv not
activated."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pace
from plait import Database
from spark_cluster import connect_server, standalone_cluster
from stream_helpers import create_generator, create_table

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

INSERT = (
    "INSERT INTO events (stream_id, instance_name, payload)"
    " SELECT {id}, %s, %s || g FROM generate_series(1, %s) g RETURNING stream_id"
)
BATCH_READ = """
import sys
import plait.spark
from plait.spark.session import quiet_session
spark = quiet_session("plait-cluster-batch", master=sys.argv[1])
rows = plait.spark.batch(spark, sys.argv[2], "events", maxIdsPerPartition=300).collect()
ids = [r.stream_id for r in rows]
print(len(ids), len(set(ids)), sum(ids))
spark.stop()
"""


async def write(db: Database, count: int) -> list[int]:
    ids: list[int] = []
    for name in ("w1", "w2"):
        gen = await create_generator(db, ["w1", "w2"], name)
        try:
            ids += await gen.insert(INSERT, (name, f"{name}-", count))
            await gen.flush_position()
        finally:
            await gen.close()
    return ids


def as_user(args: list[str], cwd: Path, exit_code: int = 0) -> subprocess.CompletedProcess[str]:
    """A command as a user runs it: the venv's script, PATH without the venv; it must
    exit with `exit_code`. 3 commands and the cluster's start (2 x 120 s) stay within
    the test's timeout on a quiet machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "VIRTUAL_ENV"))}
    env["PATH"] = "/usr/bin:/bin"
    done = pace.run(args, 180, env=env, capture_output=True, text=True, cwd=cwd)
    why = f"{args[:2]} exited {done.returncode}:\n{done.stderr[-4000:]}"
    assert done.returncode == exit_code, why
    return done


def run(args: list[str], cwd: Path) -> str:
    """A command that must succeed: its standard output."""
    return as_user(args, cwd).stdout


def run_failing(args: list[str], cwd: Path) -> str:
    """A command that must fail with plait's one-line error (exit 2): its stderr."""
    return as_user(args, cwd, exit_code=2).stderr


async def test_a_standalone_cluster_reads_every_row_once_in_batch_and_across_a_restart(
    db: Database, tmp_path: Path
) -> None:
    await create_table(db)
    written = await write(db, 700)
    plait = str(Path(sys.executable).parent / "plait")
    with contextlib.ExitStack() as stack:
        cluster = await asyncio.to_thread(
            stack.enter_context, standalone_cluster(tmp_path / "cluster")
        )
        # Executors whose Python lacks plait (a bare venv): one line saying what to do,
        # before any query starts (it was a long traceback from the first read).
        bare = tmp_path / "bare"
        await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True
        )
        unready = [
            plait, "export", "--master", cluster.master, "--dsn", db.dsn,
            "--stream", "events", "--checkpoint", "ck-bare", "--path", "bare-out", "--once",
            "--conf", f"spark.pyspark.python={bare / 'bin' / 'python'}",
        ]  # fmt: skip
        refused = await asyncio.to_thread(run_failing, unready, tmp_path)
        assert "cannot import what a plait read needs" in refused
        assert "No module named 'plait'" in refused
        assert "Traceback" not in refused
        export = [
            plait, "export", "--master", cluster.master, "--dsn", db.dsn, "--stream", "events",
            "--checkpoint", str(tmp_path / "ck"), "--path", str(tmp_path / "out"),
            "--max-rows-per-trigger", "500", "--once",
            "--conf", "spark.app.name=plait-cluster-export",  # passed through to Spark
        ]  # fmt: skip
        await asyncio.to_thread(run, export, tmp_path)
        written += await write(db, 300)  # while no query runs: the restart picks them up
        await asyncio.to_thread(run, export, tmp_path)
        # Delta: the executor (another process, another working folder) writes the
        # files under a path given relative to the command's folder.
        delta = [
            plait, "export", "--master", cluster.master, "--dsn", db.dsn, "--stream", "events",
            "--to", "delta", "--checkpoint", "ck-delta", "--path", "delta", "--once",
        ]  # fmt: skip
        await asyncio.to_thread(run, delta, tmp_path)
        batch = [sys.executable, "-c", BATCH_READ, cluster.master, db.dsn]
        count, distinct, total = map(int, (await asyncio.to_thread(run, batch, tmp_path)).split())
        apps = list((tmp_path / "cluster" / "worker").glob("app-*"))
        master_log = (tmp_path / "cluster" / "logs" / "master.log").read_text()
    assert (count, distinct, total) == (len(written), len(written), sum(written))
    import pyarrow.parquet as pq

    ids = pq.read_table(tmp_path / "out", columns=["stream_id"])["stream_id"].to_pylist()
    assert sorted(ids) == sorted(written)  # every row once across the restart
    from deltalake import DeltaTable

    delta_ids = DeltaTable(str(tmp_path / "delta")).to_pyarrow_table(columns=["stream_id"])
    assert sorted(delta_ids["stream_id"].to_pylist()) == sorted(written)
    assert len(apps) == 5, "each command ran its tasks on the cluster's executor"
    assert master_log.count("Registering app plait-cluster-export") == 2


async def test_a_packed_environment_in_spark_archives_reads_every_row_once(
    db: Database, tmp_path: Path
) -> None:
    """Spark's route for Python dependencies: a venv with plait, packed (venv-pack) and
    shipped with spark.archives; the executors run its Python. The driver plans with
    that same relative path, so run from a folder without it, `plait export` says in one
    line to unpack the archive there too; with it unpacked there, two exports with rows
    written between read every row once, and the executors ran the shipped Python."""
    await create_table(db)
    written = await write(db, 400)
    packed = await asyncio.to_thread(_packed_environment, tmp_path / "pack")
    plait = str(Path(sys.executable).parent / "plait")
    here = tmp_path / "run"
    here.mkdir()
    with contextlib.ExitStack() as stack:
        cluster = await asyncio.to_thread(
            stack.enter_context, standalone_cluster(tmp_path / "cluster")
        )
        export = [
            plait, "export", "--master", cluster.master, "--dsn", db.dsn, "--stream", "events",
            "--checkpoint", str(tmp_path / "ck"), "--path", str(tmp_path / "out"), "--once",
            "--conf", f"spark.archives={packed}#environment",
            "--conf", "spark.pyspark.python=./environment/bin/python",
        ]  # fmt: skip
        refused = await asyncio.to_thread(run_failing, export, here)
        assert "does not exist in this folder" in refused
        assert "tar -xzf env.tar.gz -C environment" in refused
        assert len(refused.strip().splitlines()) == 1, refused
        (here / "environment").mkdir()
        await asyncio.to_thread(
            subprocess.run, ["tar", "-xzf", str(packed), "-C", "environment"], cwd=here, check=True
        )
        await asyncio.to_thread(run, export, here)
        written += await write(db, 200)
        await asyncio.to_thread(run, export, here)
        shipped = list((tmp_path / "cluster" / "worker").glob("app-*/*/environment/bin/python"))
    import pyarrow.parquet as pq

    ids = pq.read_table(tmp_path / "out", columns=["stream_id"])["stream_id"].to_pylist()
    assert sorted(ids) == sorted(written)  # every row once across the restart
    assert len(shipped) == 2, "each export's executor unpacked the archive"


def _packed_environment(work: Path) -> Path:
    """A venv with plait (a wheel of this checkout), pyarrow and the ADBC driver, and
    no PySpark (the executors take it from Spark), packed with venv-pack."""
    from importlib.metadata import version

    work.mkdir()
    root = Path(__file__).resolve().parent.parent

    def run(*args: str) -> None:
        done = pace.run(args, 600, capture_output=True, text=True, cwd=work)
        assert done.returncode == 0, f"{args[:4]}:\n{done.stderr[-3000:]}"

    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work), str(root))
    run(sys.executable, "-m", "venv", "env")
    needs = [f"{name}=={version(name)}" for name in ("pyarrow", "adbc-driver-postgresql")]
    run("env/bin/python", "-m", "pip", "install", "-q", *map(str, work.glob("*.whl")), *needs)
    run(sys.executable, "-m", "venv_pack", "-p", "env", "-o", "env.tar.gz", "--compress-level", "1")
    return work / "env.tar.gz"


CONNECT_READ = """
import sys
import plait.spark
from plait.spark.session import quiet_session
spark = quiet_session(remote=sys.argv[1])
frame = plait.spark.batch(spark, sys.argv[2], "events").where("instance_name = 'w2'")
ids = [r.stream_id for r in frame.collect()]
print(len(ids), len(set(ids)), sum(ids))
spark.stop()
"""


async def test_over_spark_connect_exports_and_reads_every_row_once(
    db: Database, tmp_path: Path
) -> None:
    """`plait export --remote sc://...` (Parquet twice with rows written between, and
    Delta, whose batches the server's Python writes), `plait derive --remote` and a
    filtered batch read from a Connect client: every row once."""
    await create_table(db)
    written = await write(db, 600)
    plait = str(Path(sys.executable).parent / "plait")
    with contextlib.ExitStack() as stack:
        server = await asyncio.to_thread(stack.enter_context, connect_server(tmp_path / "server"))

        def export(to: str) -> list[str]:
            return [
                plait, "export", "--remote", server.url, "--dsn", db.dsn, "--stream", "events",
                "--to", to, "--checkpoint", str(tmp_path / f"ck-{to}"),
                "--path", str(tmp_path / to), "--max-rows-per-trigger", "500", "--once",
            ]  # fmt: skip

        await asyncio.to_thread(run, export("parquet"), tmp_path)
        written += await write(db, 200)
        await asyncio.to_thread(run, export("parquet"), tmp_path)
        await asyncio.to_thread(run, export("delta"), tmp_path)
        derive = [
            plait, "derive", "--remote", server.url, "--dsn", db.dsn, "--stream", "events",
            "--checkpoint", str(tmp_path / "ck-derive"), "--target-table", "latest_by_writer",
            "--key", "instance_name", "--max-rows-per-trigger", "500", "--once",
        ]  # fmt: skip
        await asyncio.to_thread(run, derive, tmp_path)
        read = [sys.executable, "-c", CONNECT_READ, server.url, db.dsn]
        count, distinct, total = map(int, (await asyncio.to_thread(run, read, tmp_path)).split())
        served = server.log.read_text(errors="replace")
    import pyarrow.parquet as pq
    from deltalake import DeltaTable

    ids = pq.read_table(tmp_path / "parquet", columns=["stream_id"])["stream_id"].to_pylist()
    assert sorted(ids) == sorted(written)  # every row once across the restart
    delta = DeltaTable(str(tmp_path / "delta")).to_pyarrow_table(columns=["stream_id"])
    assert sorted(delta["stream_id"].to_pylist()) == sorted(written)
    # w2's rows: the second half of each write (write() inserts w1's, then w2's)
    w2 = [i for i in written if i in set(await _ids_of(db, "w2"))]
    assert (count, distinct, total) == (len(w2), len(w2), sum(w2))
    # derive kept each writer's latest row, through the server's Python.
    async with db.connection() as conn:
        cur = await conn.execute("SELECT key, stream_id FROM latest_by_writer ORDER BY key")
        kept = await cur.fetchall()
    assert kept == [("w1", max(await _ids_of(db, "w1"))), ("w2", max(await _ids_of(db, "w2")))]
    # The server ran the three exports and the derive (not a local Spark of the client's).
    assert served.count("terminating this Trigger.AvailableNow query") == 4


async def _ids_of(db: Database, writer: str) -> list[int]:
    async with db.connection() as conn:
        cur = await conn.execute("SELECT stream_id FROM events WHERE instance_name = %s", (writer,))
        return [row[0] for row in await cur.fetchall()]
