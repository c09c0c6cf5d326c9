"""A writer process for test_pg_crash_writers: `python crash_writer.py ARGS_JSON`.

It starts writer `name` of stream "events" (writers `writers`), then does `action`:
- "no_rows": commits one row, then takes two IDs and writes nothing with them, as
  writes that failed (its position then names an ID no row shows; the IDs' sequence
  record is flushed, by the commit of the statement that took them or of the row);
- "idle": writes nothing; says `{"started": true}` once registered, reads a position
  from its stdin (another writer's, reached after this one registered), and waits until
  the idle rule moves its own position there (learned from `stream_positions`).
It prints its own position as one JSON line, `{"reported": N}`, once it has stored it
(asynchronously, as every routine store), and then waits to be killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec
from plait.storage.incarnation import Incarnation


async def main(args: dict[str, Any]) -> None:
    name = args["name"]
    spec = StreamSpec("events", tables=[TableSpec("events")], writers=args["writers"])
    db = await Database.connect(args["dsn"], max_size=4, incarnation=Incarnation.new(name))
    gen = await MultiWriterIdGenerator.create(db, spec, name, position_flush_interval=0.1)
    if args["action"] == "no_rows":
        await gen.insert(f"INSERT INTO events VALUES ({{id}}, '{name}', 'x') RETURNING stream_id")
        for _ in range(2):
            async with gen.get_next():
                pass  # nothing written: the ID finishes without a row
    else:
        print(json.dumps({"started": True}), flush=True)
        at_least = int(await asyncio.to_thread(sys.stdin.readline))
        # Polled: a position learned from stream_positions calls no listener.
        while gen.get_current_token_for_writer(name) < at_least:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    await gen.flush_position()
    print(json.dumps({"reported": gen.get_current_token_for_writer(name)}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
