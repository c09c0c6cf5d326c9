"""A writer process for the partition tests: `python partition_roles.py ARGS_JSON`.

It takes one ID in a transaction, writes its row, prints "holding <id> <epoch>" and keeps the
transaction open forever, running a statement every "every" seconds, as a live writer
in a long transaction would (never idle for long): the test then cuts it off from
PostgreSQL. Its pool has
one connection (the transaction's), so that the only server process carrying its name
is the one the partition leaves idle in a transaction. "timeouts", when given, are its
`DatabaseTimeouts`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec
from plait.storage.incarnation import Incarnation

INSERT = "INSERT INTO events (stream_id, instance_name, payload) VALUES (%s, %s, %s)"


async def main(args: dict[str, Any]) -> None:
    name = str(args["name"])
    extra: dict[str, Any] = {}
    if "timeouts" in args:
        from plait.storage.timeouts import DatabaseTimeouts

        extra["timeouts"] = DatabaseTimeouts(**args["timeouts"])
    run = Incarnation.new(name)
    db = await Database.connect(args["dsn"], min_size=1, max_size=1, incarnation=run, **extra)
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=args["writers"])
    gen = await MultiWriterIdGenerator.create(
        db, spec, name, position_flush_interval=3600.0, fence_after=None
    )
    try:
        async with db.transaction() as txn:
            stream_id = await gen.get_next_txn(txn)
            await txn.execute(INSERT, (stream_id, name, f"{name}:held"))
            print(f"holding {stream_id} {run.epoch}", flush=True)
            while True:
                await asyncio.sleep(float(args["every"]))
                await txn.execute("SELECT 1")
    except Exception as err:
        # What the writer learned; then out at once: its pool would go on trying to
        # reconnect (a fenced run may not), which is not what this test is about.
        print(f"ended {type(err).__name__}: {err}", flush=True)
        os._exit(1)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
