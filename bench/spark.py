"""Spark benchmarks (issue 5), each against a baseline measured in the same run.

- read: 1 M rows from 2 writers read by the plait source and by Spark's own JDBC source
  (the PostgreSQL JDBC driver from Debian's `libpostgresql-jdbc-java`, installed for
  the benchmark only), on the same table, with the same number of partitions, into the
  same sink (`noop`: read everything, write nothing). Target: plait >= 1.0x JDBC.
  Repetitions alternate which source goes first.
- micro_batches: a streaming query with a small `maxRowsPerTrigger`: seconds per
  micro-batch, against Spark's own `rate-micro-batch` source making as many rows per
  batch (same session, sink and trigger), and one batch read of as many rows.

With `--cluster`, both read on a standalone cluster this script starts from the
installed PySpark (a master and one worker, `--cores` cores, 2 GiB; the tests' helper
`tests/spark_cluster.py`): the executor and its Python workers are processes of their
own, as on a cluster, and the micro-batch figure is skipped.

    apt-get install -y libpostgresql-jdbc-java    # once: the JDBC driver
    python bench/spark.py [--rows N] [--reps N] [--warmup N] [--partitions N]
                          [--partitioning slices|writers] [--cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from psycopg import AsyncConnection

import common
from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec

JDBC_JAR = Path("/usr/share/java/postgresql.jar")
TESTS = str(Path(__file__).resolve().parent.parent / "tests")  # spark_cluster.py
INSERT = (
    "INSERT INTO events (stream_id, instance_name, room, payload, amount)"
    " SELECT {id}, %s, 'room' || (g %% 100), repeat('x', 60) || g, g * 0.01"
    " FROM generate_series(1, %s::int) g RETURNING stream_id"
)


async def prepare(dsn: str, rows: int) -> None:
    db = await Database.connect(dsn, min_size=1, max_size=4)
    await db.migrate()
    async with db.connection() as conn:
        await conn.execute(
            "CREATE TABLE events (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
            " room TEXT NOT NULL, payload TEXT, amount NUMERIC(12,2),"
            " at TIMESTAMPTZ NOT NULL DEFAULT now());"
            " CREATE INDEX ON events (instance_name, stream_id);"
            " CREATE INDEX ON events (stream_id)"
        )
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=["w1", "w2"])
    gens = [await MultiWriterIdGenerator.create(db, spec, name) for name in ("w1", "w2")]
    chunk = 50_000
    for start in range(0, rows, chunk):  # the two writers take turns: interleaved IDs
        gen = gens[(start // chunk) % 2]
        await gen.insert(INSERT, (gen.instance_name, min(chunk, rows - start)))
    for gen in gens:
        await gen.close()
    async with db.connection() as conn:
        await conn.execute("VACUUM ANALYZE events")
    await db.close()


def jdbc_url(dsn: str) -> tuple[str, dict[str, str]]:
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(dsn)
    host, port, name = params.get("host", "127.0.0.1"), params.get("port", "5432"), params["dbname"]
    options = str(params.get("options", ""))
    schema = options.split("search_path=")[-1].split()[0] if "search_path=" in options else ""
    url = f"jdbc:postgresql://{host}:{port}/{name}"
    if schema:
        url += f"?currentSchema={schema}"
    return url, {"user": str(params.get("user", "postgres")), "driver": "org.postgresql.Driver"}


def timed_read(frame: Any) -> float:
    started = time.perf_counter()
    frame.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - started


class CpuMeter:
    """CPU seconds a read costs each process group: Spark's JVM, its Python workers
    (the JVM's descendants), and PostgreSQL (when it runs on this machine). On a
    standalone cluster, also the driver's JVM alone, and as "jvm" and "python_workers"
    the executor's JVM and its Python workers (the cluster worker's child)."""

    def __init__(self, postmaster: int | None, cluster_worker: int | None = None) -> None:
        self.jvm = common.child_named("java")
        self.cluster_worker = cluster_worker
        self.postmaster = postmaster

    def now(self) -> dict[str, float]:
        out: dict[str, float] = {}
        executor = None
        if self.cluster_worker is not None:
            executor = common.child_named("java", self.cluster_worker)
        if executor is not None:
            out["jvm"], out["python_workers"] = common.tree_cpu_seconds(executor)
            if self.jvm is not None:
                out["driver_jvm"] = common.tree_cpu_seconds(self.jvm)[0]
        elif self.jvm is not None:
            out["jvm"], out["python_workers"] = common.tree_cpu_seconds(self.jvm)
        server = common.server_cpu_seconds(self.postmaster)
        if server is not None:
            out["postgresql"] = server
        return out


def read_figure(spark: Any, dsn: str, args: argparse.Namespace, meter: CpuMeter) -> None:
    rows, reps, partitions, warmup = args.rows, args.reps, args.partitions, args.warmup
    url, props = jdbc_url(dsn)
    low, high = id_bounds(dsn)
    # The plait source cuts the IDs it reads, (0, high], into equal slices of at most
    # this many: `partitions` of them, like JDBC's numPartitions over [low, high]. (By
    # writer, each writer range is cut by the same limit: about as many tasks; the
    # figure reports how many each source had.)
    writers = 2
    per_partition = -(-high // partitions)

    def plait_frame() -> Any:  # the reader itself, as JDBC's (no option checks first)
        return (
            spark.read.format("plait")
            .option("dsn", dsn)
            .option("stream", "events")
            .option("maxIdsPerPartition", per_partition)
            .option("partitioning", args.partitioning)
            .load()
        )

    def jdbc_frame() -> Any:
        return spark.read.jdbc(
            url,
            "events",
            column="stream_id",
            lowerBound=low,
            upperBound=high + 1,
            numPartitions=partitions,
            properties={**props, "fetchsize": "10000"},
        )

    plait_parts = plait_frame().rdd.getNumPartitions()
    jdbc_parts = jdbc_frame().rdd.getNumPartitions()
    assert plait_frame().count() == jdbc_frame().count() == rows
    for _ in range(warmup):  # both to steady state: JIT-compiled, Python workers loaded
        timed_read(plait_frame())
        timed_read(jdbc_frame())
    seconds: dict[str, list[float]] = {"plait": [], "jdbc": []}
    cpu: dict[str, dict[str, list[float]]] = {"plait": {}, "jdbc": {}}
    for rep in range(reps):
        order = [("plait", plait_frame), ("jdbc", jdbc_frame)]
        for name, make in common.rotated(order, rep):
            frame = make()
            before = meter.now()
            seconds[name].append(timed_read(frame))
            after = meter.now()
            for group, value in after.items():
                cpu[name].setdefault(group, []).append(value - before[group])
    plait_s, jdbc_s = seconds["plait"], seconds["jdbc"]
    p, j = common.median(plait_s), common.median(jdbc_s)
    common.emit(
        {
            "figure": "read_1m_rows",
            "rows": rows,
            "writers": writers,
            "partitioning": args.partitioning,
            "master": spark.sparkContext.master,
            "partitions": {"plait": plait_parts, "jdbc": jdbc_parts},
            "plait_s": common.rnd(p, 3),
            "jdbc_s": common.rnd(j, 3),
            "plait_rows_per_s": round(rows / p),
            "jdbc_rows_per_s": round(rows / j),
            "plait_vs_jdbc_speed": common.rnd(j / p, 3),
            "samples_plait_s": [common.rnd(v, 3) for v in plait_s],
            "samples_jdbc_s": [common.rnd(v, 3) for v in jdbc_s],
            "median_cpu_s_per_read": {
                name: {group: common.rnd(common.median(v), 3) for group, v in groups.items()}
                for name, groups in cpu.items()
            },
            "warmup_reads_each": warmup,
            "versions": versions(),
            "target": "plait >= 1.0x JDBC",
        }
    )


def versions() -> dict[str, str]:
    """What the figure depends on: the ADBC driver's build decides the decoding cost."""
    from importlib.metadata import version

    return {name: version(name) for name in ("pyspark", "pyarrow", "adbc-driver-postgresql")}


def id_bounds(dsn: str) -> tuple[int, int]:
    """The smallest and largest stream ID of the table."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT min(stream_id), max(stream_id) FROM events").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def run_micro_batches(frame: Any, batches: int) -> list[Any]:
    """Progress of `batches` micro-batches of a query writing `frame` to `noop`, past the
    first two (start-up)."""
    with tempfile.TemporaryDirectory() as folder:
        query = (
            frame.writeStream.format("noop")
            .option("checkpointLocation", str(Path(folder) / "ck"))
            .trigger(processingTime="0 seconds")
            .start()
        )
        while len(query.recentProgress) < batches + 2:
            time.sleep(0.05)
        query.stop()
    return list(query.recentProgress[2 : batches + 2])


def micro_batches(spark: Any, dsn: str, rows_per_batch: int, batches: int) -> None:
    """Seconds per micro-batch of the plait source, against Spark's own
    `rate-micro-batch` source making as many rows a batch, in the same session, sink and
    trigger: what plait adds per batch (offsets, planning, one query per batch)."""
    import plait.spark

    plait_frame = plait.spark.stream(spark, dsn, "events", maxRowsPerTrigger=rows_per_batch)
    rate_frame = (
        spark.readStream.format("rate-micro-batch").option("rowsPerBatch", rows_per_batch).load()
    )
    run_micro_batches(rate_frame, 3)  # warm up the streaming path
    progress = run_micro_batches(plait_frame, batches)
    baseline = run_micro_batches(rate_frame, batches)

    def seconds(runs: list[Any]) -> list[float]:
        return [p.durationMs["triggerExecution"] / 1000 for p in runs]

    per_batch, per_rate_batch = seconds(progress), seconds(baseline)
    phases = {
        key: common.rnd(common.median([p.durationMs.get(key, 0) / 1000 for p in progress]), 3)
        for key in progress[0].durationMs
        if key != "triggerExecution"
    }
    started = time.perf_counter()
    few = plait.spark.batch(
        spark, dsn, "events", startToken='{"min":0}', endToken=f'{{"min":{rows_per_batch}}}'
    )
    few.write.format("noop").mode("overwrite").save()
    one_read = time.perf_counter() - started
    common.emit(
        {
            "figure": "micro_batch_overhead",
            "rows_per_batch": rows_per_batch,
            "batches": len(per_batch),
            "rows": sum(p.numInputRows for p in progress),
            "median_s_per_batch": common.rnd(common.median(per_batch), 3),
            "p90_s_per_batch": common.rnd(sorted(per_batch)[int(0.9 * len(per_batch))], 3),
            "rate_source_median_s_per_batch": common.rnd(common.median(per_rate_batch), 3),
            "plait_added_s_per_batch": common.rnd(
                common.median(per_batch) - common.median(per_rate_batch), 3
            ),
            "batch_read_of_as_many_rows_s": common.rnd(one_read, 3),
            "median_s_by_phase": phases,
        }
    )


async def main(args: argparse.Namespace) -> None:
    if not JDBC_JAR.exists():  # noqa: ASYNC240 - once, before anything runs
        common.log(f"no {JDBC_JAR}: apt-get install -y libpostgresql-jdbc-java")
        raise SystemExit(2)
    async with (
        common.server(args.dsn) as server_dsn,
        common.bench_schema(server_dsn, "spark") as dsn,
    ):
        common.log(f"writing {args.rows} rows from 2 writers")
        await prepare(dsn, args.rows)
        from plait.spark.session import quiet_session

        with contextlib.ExitStack() as stack:
            master = f"local[{args.cores}]"
            worker = None
            if args.cluster:
                sys.path.insert(0, TESTS)
                from spark_cluster import standalone_cluster

                work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                common.log("starting a standalone cluster")
                cluster = stack.enter_context(standalone_cluster(work, cores=args.cores))
                master, worker = cluster.master, cluster.worker_pid
            spark = quiet_session("plait-bench", master=master, conf={"spark.jars": str(JDBC_JAR)})
            stack.callback(spark.stop)
            common.log(f"read: plait vs JDBC on {master}")
            async with await AsyncConnection.connect(dsn) as conn:
                meter = CpuMeter(await common.find_postmaster(conn), worker)
            await asyncio.to_thread(read_figure, spark, dsn, args, meter)
            if not args.cluster:
                common.log("micro-batches")
                await asyncio.to_thread(micro_batches, spark, dsn, args.batch_rows, args.batches)


# --smoke: the smallest sizes that still go through every step.
SMOKE = [
    "--rows", "2000", "--reps", "1", "--warmup", "0", "--partitions", "2",
    "--batch-rows", "100", "--batches", "3",
]  # fmt: skip

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=3, help="untimed reads of each first")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--partitioning", choices=["slices", "writers"], default="slices")
    parser.add_argument("--cluster", action="store_true", help="on a standalone cluster")
    parser.add_argument("--batch-rows", type=int, default=1000, help="rows per micro-batch")
    parser.add_argument("--batches", type=int, default=20, help="micro-batches measured")
    args = common.parse(parser, SMOKE)
    # Every measured batch must be full: past the rows, a streaming query without new
    # data reports progress only every 10 s.
    if args.rows < args.batch_rows * (args.batches + 2):
        parser.error("--rows must be at least --batch-rows x (--batches + 2)")
    common.run(main, args)
