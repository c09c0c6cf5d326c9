"""A writer process for the fencing tests: `python fence_roles.py ARGS_JSON`.

It writes one row per transaction, forever, each transaction held open for a random
while (so a kill -9 lands in the middle of one), and prints each committed ID. Its
database pool carries a fresh incarnation, as an `Instance`'s does.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec
from plait.storage.incarnation import Incarnation

INSERT = "INSERT INTO events (stream_id, instance_name, payload) VALUES (%s, %s, %s)"


async def main(args: dict[str, object]) -> None:
    name = str(args["name"])
    rng = random.Random()
    db = await Database.connect(str(args["dsn"]), max_size=6, incarnation=Incarnation.new(name))
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=list(args["writers"]))  # type: ignore[call-overload]
    gen = await MultiWriterIdGenerator.create(
        db, spec, name, position_flush_interval=0.2, fence_after=1.0
    )
    print("started", flush=True)

    async def one(i: int) -> None:
        async with db.transaction() as txn:
            stream_id = await gen.get_next_txn(txn)
            await txn.execute(INSERT, (stream_id, name, f"{name}:{i}"))
            await asyncio.sleep(rng.uniform(0, 0.05))
        print(stream_id, flush=True)

    i = 0
    while True:  # four transactions at a time, until killed
        await asyncio.gather(*(one(i + k) for k in range(4)))
        i += 4


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
