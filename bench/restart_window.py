"""After a restart: what catching up heard positions costs a writer, and only then.

For `HEARD_AFTER_RESTART` (10 s) after a writer's new connection found PostgreSQL
restarted, a position another process reports above what the writer knew may name an
ID the crash took the sequence back below; the writer catches the sequence up before
its next statement (R-ID-14). Measured: writer `a` inserts one row per statement while
writer `b` (another Database, as another process would) inserts too and `a` hears each
of `b`'s positions as replication would hand them on (`vouched`). Figures (one JSON
line each), rounds alternating:
- `outside`: inserts/s of `a` in normal operation (the baseline);
- `inside`: the same inside the window, and the ratio to the baseline.
A restart cannot be ordered on a shared server, so `inside` opens the window the way a
new connection that found the server restarted does (`_Identity.restarted_at`).

Run: python bench/restart_window.py [--quick] [--dsn DSN] [--rounds 4] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from common import (
    EVENTS_DDL,
    add_common_args,
    bench_schema,
    emit,
    log,
    median,
    parse,
    rnd,
    run,
    server,
    server_info,
)
from plait import Database, MultiWriterIdGenerator, StreamSpec, TableSpec

SPEC = StreamSpec("events", sequence="events_seq", tables=[TableSpec("events")], writers=["a", "b"])
INSERT = "INSERT INTO events (stream_id, instance_name) VALUES ({id}, %s) RETURNING stream_id"


async def one_round(dsn: str, seconds: float, *, inside: bool) -> float:
    """Inserts per second of writer `a` while `b` writes and `a` hears it."""
    a_db = await Database.connect(dsn, max_size=4)
    b_db = await Database.connect(dsn, max_size=4)
    try:
        a = await MultiWriterIdGenerator.create(a_db, SPEC, "a")
        b = await MultiWriterIdGenerator.create(b_db, SPEC, "b")
        stop = asyncio.Event()

        async def peer() -> None:
            while not stop.is_set():
                position = (await b.insert(INSERT, ("b",)))[0]
                a.vouched("b", position)  # what a POSITION from b does

        task = asyncio.create_task(peer())
        if inside:
            a_db._identity.restarted_at = time.monotonic()  # as a restart would (docstring)
        writes = 0
        started = time.monotonic()
        try:
            while time.monotonic() - started < seconds:
                await a.insert(INSERT, ("a",))
                writes += 1
        finally:
            stop.set()
            await task
        rate = writes / (time.monotonic() - started)
        await a.close()
        await b.close()
        return rate
    finally:
        await a_db.close()
        await b_db.close()


async def main(args: argparse.Namespace) -> None:
    rounds, seconds = (2, 1.0) if args.quick else (args.rounds, args.seconds)
    if seconds >= 10:
        sys.exit("--seconds must be under 10: the window lasts 10 s")
    async with server(args.dsn) as server_dsn:
        log(f"server: {await server_info(server_dsn)}")
        outside: list[float] = []
        inside: list[float] = []
        for r in range(rounds):
            for window in (False, True):
                async with bench_schema(server_dsn, "restart_window") as dsn:
                    setup = await Database.connect(dsn, max_size=1)
                    try:
                        await setup.migrate()
                        async with setup.connection() as conn:
                            await conn.execute(EVENTS_DDL)
                    finally:
                        await setup.close()
                    rate = await one_round(dsn, seconds, inside=window)
                (inside if window else outside).append(rate)
                log(f"round {r + 1}: {'inside' if window else 'outside'} {rate:.0f} inserts/s")
    emit(
        {
            "figure": "a writer's inserts/s while a peer writes: outside the window",
            "inserts_per_s": rnd(median(outside), 1),
            "rounds": [rnd(x, 1) for x in outside],
        }
    )
    emit(
        {
            "figure": "the same inside the 10 s after a restart, and the ratio",
            "inserts_per_s": rnd(median(inside), 1),
            "ratio": rnd(median(inside) / median(outside), 2),
            "rounds": [rnd(x, 1) for x in inside],
        }
    )


# --smoke: the smallest sizes that still go through every step.
SMOKE = ["--rounds", "1", "--seconds", "0.5"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per variant")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per round (< 10)")
    return parse(parser, SMOKE, argv)


if __name__ == "__main__":
    run(main, parse_args(sys.argv[1:]))
