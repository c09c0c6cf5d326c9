"""The Delta export's driver memory as the batch grows (issue 19): one batch of N rows
(no row limit) exported to Delta Lake by a driver process of its own, whose peak
resident memory (VmHWM) is read while it runs: the Python driver, and the JVM it starts
(local mode: the executors run in it too).

Each size is exported twice in the same run: by plait's export (the tasks write the
files, the driver commits them) and by the way it worked before (`toArrow()` on the
driver, then `write_deltalake`), the baseline. The figure: each one's peak at the large
size against the small one (flat: about 1.0x) and plait's against the baseline's.

    python bench/delta_export.py [--sizes 1000000,4000000] [--cores 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec

INSERT = (
    "INSERT INTO events (stream_id, instance_name, room, payload)"
    " SELECT {id}, %s, 'room' || (g %% 100), repeat('x', 60) || g"
    " FROM generate_series(1, %s::int) g RETURNING stream_id"
)
CHILD = """
import sys, time
from plait.spark import pipelines
from plait.spark.session import quiet_session

mode, dsn, path, checkpoint, cores = sys.argv[1:6]


class Collecting:  # the export as it was: the whole batch through the driver
    def __call__(self, frame, batch_id):
        from deltalake import write_deltalake
        write_deltalake(path, frame.toArrow(), mode="append")


spark = quiet_session("plait-bench-delta", master=f"local[{cores}]")
frame = pipelines.Source(dsn, "events").frame(spark)
batches = pipelines.DeltaBatches(path, checkpoint, []) if mode == "plait" else Collecting()
started = time.monotonic()
query = (
    frame.writeStream.foreachBatch(batches).option("checkpointLocation", checkpoint)
    .trigger(availableNow=True).start()
)
query.awaitTermination()
print(time.monotonic() - started, flush=True)
spark.stop()
"""


async def prepare(dsn: str, rows: int, done: int) -> None:
    """Rows `done` to `rows` of the stream (two writers taking turns)."""
    db = await Database.connect(dsn, min_size=1, max_size=4)
    await db.migrate()
    if done == 0:
        async with db.connection() as conn:
            await conn.execute(
                "CREATE TABLE events (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
                " room TEXT NOT NULL, payload TEXT); CREATE INDEX ON events (instance_name,"
                " stream_id)"
            )
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=["w1", "w2"])
    gens = [await MultiWriterIdGenerator.create(db, spec, name) for name in ("w1", "w2")]
    chunk = 50_000
    for start in range(done, rows, chunk):
        gen = gens[(start // chunk) % 2]
        await gen.insert(INSERT, (gen.instance_name, min(chunk, rows - start)))
    for gen in gens:
        await gen.flush_position()
        await gen.close()
    async with db.connection() as conn:
        await conn.execute("VACUUM ANALYZE events")
    await db.close()


def _peak_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _java_children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid and comm == "java":
            found.append(int(entry.name))
    return found


def export(mode: str, dsn: str, cores: int) -> dict[str, float]:
    """One export in a driver process of its own: its seconds and peak memory (MiB)."""
    with tempfile.TemporaryDirectory() as work:
        command = [sys.executable, "-c", CHILD, mode, dsn, f"{work}/delta", f"{work}/ck"]
        process = subprocess.Popen(
            [*command, str(cores)],
            stdout=subprocess.PIPE,
            text=True,
        )
        python_peak = jvm_peak = 0
        while process.poll() is None:
            python_peak = max(python_peak, _peak_kib(process.pid) or 0)
            for java in _java_children(process.pid):
                jvm_peak = max(jvm_peak, _peak_kib(java) or 0)
            time.sleep(0.1)
        out = process.stdout.read() if process.stdout else ""
    return {
        # A driver that ran out of memory fails: that is a figure too.
        "seconds": round(float(out.split()[-1]), 2) if process.returncode == 0 else float("nan"),
        "exit": process.returncode,
        "python_driver_peak_mib": round(python_peak / 1024, 1),
        "jvm_peak_mib": round(jvm_peak / 1024, 1),
    }


async def main(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.quick:
        sizes = [20_000, 80_000]
    async with (
        common.server(args.dsn) as server_dsn,
        common.bench_schema(server_dsn, "delta") as dsn,
    ):
        done = 0
        figures: dict[str, dict[int, dict[str, float]]] = {"plait": {}, "collect": {}}
        for size in sizes:
            common.log(f"writing rows up to {size}")
            await prepare(dsn, size, done)
            done = size
            for mode in ("collect", "plait"):  # alternate which one goes first
                common.log(f"{mode}: one batch of {size} rows")
                figures[mode][size] = await asyncio.to_thread(export, mode, dsn, args.cores)
                common.emit({"figure": "delta_export_batch", "mode": mode, "rows": size,
                             **figures[mode][size]})  # fmt: skip
        small, large = sizes[0], sizes[-1]
        for mode, by_size in figures.items():
            common.emit(
                {
                    "figure": "delta_export_driver_memory_growth",
                    "mode": mode,
                    "rows": [small, large],
                    "python_driver_peak_ratio": common.rnd(
                        by_size[large]["python_driver_peak_mib"]
                        / by_size[small]["python_driver_peak_mib"],
                        2,
                    ),
                    "jvm_peak_ratio": common.rnd(
                        by_size[large]["jvm_peak_mib"] / by_size[small]["jvm_peak_mib"], 2
                    ),
                }
            )
        common.emit(
            {
                "figure": "delta_export_plait_vs_collect_at_largest",
                "rows": large,
                "python_driver_peak_ratio": common.rnd(
                    figures["plait"][large]["python_driver_peak_mib"]
                    / figures["collect"][large]["python_driver_peak_mib"],
                    2,
                ),
                "seconds_ratio": common.rnd(
                    figures["plait"][large]["seconds"] / figures["collect"][large]["seconds"], 2
                ),
                "cores": os.cpu_count(),
            }
        )


# --smoke: the smallest sizes that still go through every step.
SMOKE = ["--sizes", "500,1000"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--sizes", default="1000000,4000000", help="rows per batch, small,large")
    parser.add_argument("--cores", type=int, default=2)
    common.run(main, common.parse(parser, SMOKE))
