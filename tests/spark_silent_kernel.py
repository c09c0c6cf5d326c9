"""A network that goes silent in the middle of a Spark read, for `test_spark_silent.py`:
run as root, inside a network namespace of its own (`unshare --net python
spark_silent_kernel.py ARGS_JSON`), with the namespaces of `partition_kernel.py`.

PostgreSQL runs here; a local Spark session runs in the second namespace, across the
veth pair, and reads the stream in batch. The test holds the table locked until the
reader's tasks have sent their queries and wait, then takes the link down and lets the
rows go: the server's answers and the client's keepalive probes vanish without a word,
as over a cut cable. The link comes back `down_for` seconds later. It prints one JSON
line: the reader's row count and sum, its failed task attempts, and seconds from the
cut until the read ended.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import pace
from partition_kernel import SERVER_ADDRESS, in_namespaces, sh
from plait import Database
from stream_helpers import create_generator, create_table

READER = """
import json, sys
import plait.spark
from plait.spark.session import quiet_session

spark = quiet_session("plait-silent", master="local[2]")  # task retries: local[2,4]
frame = plait.spark.batch(spark, sys.argv[1], "events", maxIdsPerPartition=2500)
spark.sparkContext.setJobGroup("read", "read")
ids = [row.stream_id for row in frame.select("stream_id").collect()]
tracker = spark.sparkContext.statusTracker()
jobs = [tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup("read")]
stages = [tracker.getStageInfo(s) for job in jobs if job for s in job.stageIds]
failed = sum(stage.numFailedTasks for stage in stages if stage)
print(json.dumps({"rows": len(ids), "distinct": len(set(ids)), "sum": sum(ids),
                  "failed_tasks": failed}), flush=True)
spark.stop()
"""


async def waiting_readers(db: Database) -> int:
    """The reader's queries waiting on the table lock."""
    async with db.connection() as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE %s",
            ('%FROM "events" WHERE%',),
        )
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def scenario(inside: list[str], local: str, args: dict[str, Any]) -> None:
    remote = local.replace("127.0.0.1", SERVER_ADDRESS)
    db = await Database.connect(local)
    await db.migrate()
    await create_table(db)
    written: list[int] = []
    for name in ("w1", "w2"):
        gen = await create_generator(db, ["w1", "w2"], name)
        written += await gen.insert(
            "INSERT INTO events (stream_id, instance_name, payload)"
            " SELECT {id}, %s, repeat('x', 200) FROM generate_series(1, 5000) g"
            " RETURNING stream_id",
            (name,),
        )
        await gen.flush_position()
        await gen.close()
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    reader = await asyncio.create_subprocess_exec(
        *inside, sys.executable, "-c", READER, remote, stdout=asyncio.subprocess.PIPE, env=env
    )
    async with db.connection() as conn, conn.transaction():
        # plait's connections end a transaction idle for 60 s; on a busy machine the
        # reader's Spark takes longer than that to reach its queries, and the lock
        # would go with the transaction (under four CPU hogs it did, and the reader
        # read everything without waiting). This one waits as long as the test does.
        await conn.execute("SET LOCAL idle_in_transaction_session_timeout = 0")
        await conn.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
        start_within = float(args["start_within"])  # at this machine's pace: the test's
        deadline = time.monotonic() + start_within
        while await waiting_readers(db) < 1:
            if time.monotonic() > deadline or reader.returncode is not None:
                raise RuntimeError(
                    f"waited {start_within:.1f} s for the reader's queries to wait on the lock"
                    f" (the reader's exit status: {reader.returncode})"
                )
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)  # both task slots' queries, most likely
        sh("ip", "link", "set", "va", "down")
        cut = time.monotonic()
    # Committed: the lock is gone, and the rows go out into the silence.
    await asyncio.sleep(float(args["down_for"]))
    sh("ip", "link", "set", "va", "up")
    assert reader.stdout is not None
    async with pace.bounded(float(args["within"]), "the reader to print its rows and end"):
        line = await reader.stdout.readline()
        await reader.wait()
    ended = time.monotonic() - cut
    result = json.loads(line) if line else {}
    expected = {"written": len(written), "written_sum": sum(written)}
    print(json.dumps({**result, **expected, "ended_after_cut": round(ended, 1)}))
    await db.close()


def main(args: dict[str, Any]) -> None:
    in_namespaces("plait-silent-", lambda inside, pg: scenario(inside, pg.dsn, args))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
