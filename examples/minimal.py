"""Two writers and a worker on one stream: python examples/minimal.py w1 | w2 | worker."""

import asyncio
import logging
import os
import sys

from plait.instance import Instance

NAME = sys.argv[1]
CONFIG = {
    "instance_name": NAME,
    "database": os.environ.get("PLAIT_DSN"),  # None: plait's embedded PostgreSQL
    "streams": [{"name": "notes", "tables": [{"name": "notes"}], "writers": ["w1", "w2"]}],
    "replication": {"transport": "tcp", "tcp": {"hub": "w1", "port": os.environ.get("HUB", 9190)}},
}
TABLE = """CREATE TABLE IF NOT EXISTS notes (stream_id BIGINT, instance_name TEXT, body TEXT);
CREATE INDEX IF NOT EXISTS notes_by_writer ON notes (instance_name, stream_id)"""
INSERT = "INSERT INTO notes VALUES ({id}, %s, %s) RETURNING *"  # {id}: a new stream ID


async def main() -> None:
    logging.basicConfig(level=logging.WARNING)  # plait's warnings (a library logs, apps show)
    instance = Instance(CONFIG)
    instance.add_schema(TABLE)  # run at start, before the stream checks its table
    seen = asyncio.Queue[int]()

    def show(stream: str, writer: str, token: int, rows: list[dict[str, str]]) -> None:
        print(writer, token, [row["body"] for row in rows], flush=True)
        seen.put_nowait(len(rows))

    instance.on_rows("notes", show)
    async with instance:  # rows written from here on reach `show`: start the worker first
        print(NAME, "started", flush=True)
        for i in range(5 if NAME != "worker" else 0):
            await instance.generator("notes").insert(INSERT, (NAME, f"{NAME}: note {i}"))
        notes = 0
        while NAME == "worker" and notes < 10:  # five notes from each writer
            notes += await seen.get()
        await asyncio.sleep(float(os.environ.get("STAY", "10")) if NAME != "worker" else 0)


asyncio.run(main())
