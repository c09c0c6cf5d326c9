"""A writer process for the fencing tests: `python fence_roles.py ARGS_JSON`.

It writes one row per transaction, forever, each transaction held open for a random
while (so a kill -9 lands in the middle of one); the database is the record of what it
committed. Its database pool carries a fresh incarnation, as an `Instance`'s does. With
a "config" in the arguments it runs as a whole `Instance` (replicating) instead of a
bare generator.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from typing import Any

from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec
from plait.instance import Instance
from plait.storage.incarnation import Incarnation
from replication_helpers import TableRows

INSERT = "INSERT INTO events (stream_id, instance_name, payload) VALUES (%s, %s, %s)"


async def main(args: dict[str, Any]) -> None:
    name = str(args["name"])
    if "config" in args:
        instance = Instance(args["config"])
        instance.row_type("events", TableRows())  # as the tests' instances send them
        await instance.start()
        db, gen = instance.db, instance.generator("events")
    else:
        db = await Database.connect(args["dsn"], max_size=6, incarnation=Incarnation.new(name))
        spec = StreamSpec("events", tables=[TableSpec("events")], writers=args["writers"])
        gen = await MultiWriterIdGenerator.create(
            db, spec, name, position_flush_interval=0.2, fence_after=1.0
        )
    rng = random.Random()
    print("started", flush=True)

    async def one(i: int) -> None:
        async with db.transaction() as txn:
            stream_id = await gen.get_next_txn(txn)
            await txn.execute(INSERT, (stream_id, name, f"{name}:{i}"))
            await asyncio.sleep(rng.uniform(0, 0.05))

    i = 0
    while True:  # four transactions at a time, until killed
        await asyncio.gather(*(one(i + k) for k in range(4)))
        i += 4


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
