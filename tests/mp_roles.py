"""Processes for the multi-process test: `python mp_roles.py writer|reader ARGS_JSON`.

Each writes JSON lines to its `out` file and takes orders from the `control` JSON file,
which the test rewrites atomically. Writers write, then stay idle (so their positions
keep advancing) until told to stop; readers follow until they reach `stop_at`.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

from plait import Database, MultiWriterIdGenerator, StreamSpec, StreamToken, TableSpec
from plait.check.plan import read_control

INSERT = "INSERT INTO events (stream_id, instance_name, payload) VALUES (%s, %s, %s)"


class Rollback(Exception):
    pass


def spec(writers: list[str]) -> StreamSpec:
    return StreamSpec("events", tables=[TableSpec("events")], writers=writers)


def emit(out: Path, **fields: Any) -> None:
    with out.open("a") as f:
        f.write(json.dumps(fields) + "\n")


async def writer(args: dict[str, Any]) -> None:
    name, out, ctl = args["name"], Path(args["out"]), Path(args["control"])
    rng = random.Random(args["seed"])
    db = await Database.connect(args["dsn"], max_size=8)
    gen = await MultiWriterIdGenerator.create(
        db, spec(args["writers"]), name, position_flush_interval=0.2
    )
    emit(
        out,
        event="start",
        positions=gen.get_positions(),
        own=gen.get_current_token_for_writer(name),
    )
    slots = asyncio.Semaphore(4)

    async def one(i: int) -> None:
        slow = rng.random() < args["slow_fraction"]
        delay = rng.uniform(1.0, 1.6) if slow else rng.uniform(0, 0.02)
        rollback = rng.random() < 0.15
        in_txn = rng.random() < 0.5
        stream_id = 0
        async with slots:
            try:
                if in_txn:
                    async with db.transaction() as txn:
                        stream_id = await gen.get_next_txn(txn)
                        await txn.execute(INSERT, (stream_id, name, f"{name}:{i}"))
                        await asyncio.sleep(delay)
                        if rollback:
                            raise Rollback
                else:
                    async with gen.get_next() as stream_id, db.transaction() as txn:
                        await txn.execute(INSERT, (stream_id, name, f"{name}:{i}"))
                        await asyncio.sleep(delay)
                        if rollback:
                            raise Rollback
            except Rollback:
                emit(out, event="rolled_back", id=stream_id)
                return
        emit(out, event="committed", id=stream_id)

    await asyncio.gather(*(one(i) for i in range(args["writes"])))
    emit(out, event="done", own=gen.get_current_token_for_writer(name))
    while not read_control(ctl).get("writers_stop"):  # noqa: ASYNC110 - another process writes it
        await asyncio.sleep(0.05)
    await gen.close()
    await db.close()
    emit(out, event="stopped")


async def reader(args: dict[str, Any]) -> None:
    mode, out, ctl = args["mode"], Path(args["out"]), Path(args["control"])
    writers: list[str] = args["writers"]
    db = await Database.connect(args["dsn"], max_size=4)
    gen = await MultiWriterIdGenerator.create(
        db, spec(writers), f"reader-{mode}", position_flush_interval=0.1
    )
    seen: list[int] = []
    start = StreamToken.from_generator(gen)
    last = {w: start.get(w) for w in writers}
    linear = gen.get_current_token()
    previous = start
    emit(out, event="start", token=start.to_json_dict())
    while True:
        await gen.refresh_positions()
        token = StreamToken.from_generator(gen)
        if not previous.is_before_or_eq(token):
            emit(
                out, event="regression", before=previous.to_json_dict(), after=token.to_json_dict()
            )
        previous = token
        if mode == "token":
            for w in writers:
                while last[w] < token.get(w):
                    rows, upto, _ = await gen.get_updates_since(w, last[w], token.get(w), 50)
                    seen.extend(r.stream_id for r in rows)
                    last[w] = upto
            reached = token.min
        else:
            target = gen.get_current_token()
            while linear < target:
                rows, upto, _ = await gen.get_updates_since(None, linear, target, 50)
                seen.extend(r.stream_id for r in rows)
                linear = upto
            reached = linear
        stop_at = read_control(ctl).get("stop_at")
        if stop_at is not None and reached >= stop_at:
            break
        await asyncio.sleep(0.05)
    emit(out, event="seen", ids=seen)
    await db.close()


if __name__ == "__main__":
    role, raw = sys.argv[1], json.loads(sys.argv[2])
    asyncio.run(writer(raw) if role == "writer" else reader(raw))
