"""Candidate readers for the Spark source (issue 5): the same 500 000 rows of a stream
table, read into Arrow (or as far as each gets), against the ADBC PostgreSQL driver the
source uses (ratios are ADBC's time over the candidate's: below 1 means slower), and the
CPU seconds each takes in this process: in a Spark read every core is busy, so the
client's CPU per row counts as much as the wall time.

- adbc: `adbc_driver_postgresql` (libpq, binary COPY, decodes straight into Arrow)
- connectorx: `connectorx.read_sql(..., return_type="arrow")`, when installed
- psycopg_tuples: psycopg 3 `fetchall()` of Python tuples, then `pyarrow.Table.from_pylist`
- psycopg_copy_raw: psycopg 3 binary COPY, bytes only, nothing decoded (a floor, not a
  reader)

    python bench/readers.py [--rows N] [--reps N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import psycopg

import common

QUERY = "SELECT stream_id, instance_name, room, payload, amount::text AS amount, at FROM events"


def setup(dsn: str, rows: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE events AS SELECT g::bigint AS stream_id, 'w' || (g %% 2) AS"
            " instance_name, 'room' || (g %% 100) AS room, repeat('x', 60) || g AS payload,"
            " (g * 0.01)::numeric(12,2) AS amount, now() AS at"
            " FROM generate_series(1, %s) g",
            (rows,),
        )
        conn.execute("VACUUM ANALYZE events")


def adbc(dsn: str) -> int:
    import adbc_driver_postgresql.dbapi as driver

    with driver.connect(dsn) as conn, conn.cursor() as cursor:
        cursor.execute(QUERY)
        return int(cursor.fetch_arrow_table().num_rows)


def connectorx(dsn: str) -> int:
    import connectorx as cx  # type: ignore[import-not-found]

    return int(cx.read_sql(_uri(dsn), QUERY, return_type="arrow").num_rows)


def psycopg_tuples(dsn: str) -> int:
    import pyarrow as pa

    with psycopg.connect(dsn) as conn:
        cursor = conn.execute(QUERY)
        names = [c.name for c in cursor.description or []]
        rows = cursor.fetchall()
    return int(pa.Table.from_pylist([dict(zip(names, r, strict=True)) for r in rows]).num_rows)


def psycopg_copy_raw(dsn: str) -> int:
    size = 0
    with (
        psycopg.connect(dsn) as conn,
        conn.cursor().copy(f"COPY ({QUERY}) TO STDOUT (FORMAT BINARY)") as copy,
    ):
        for data in copy:
            size += len(data)
    return size


def _uri(dsn: str) -> str:
    from psycopg.conninfo import conninfo_to_dict

    p = conninfo_to_dict(dsn)
    uri = f"postgresql://{p.get('user', 'postgres')}@{p.get('host', '127.0.0.1')}:"
    uri += f"{p.get('port', 5432)}/{p['dbname']}"
    options = str(p.get("options", ""))
    if "search_path=" in options:
        uri += "?options=-c%20search_path%3D" + options.split("search_path=")[-1].split()[0]
    return uri


def main(args: argparse.Namespace) -> None:
    import asyncio

    async def run() -> None:
        async with (
            common.server(args.dsn) as server_dsn,
            common.bench_schema(server_dsn, "readers") as dsn,
        ):
            setup(dsn, args.rows)
            candidates: dict[str, Callable[[str], int]] = {
                "adbc": adbc,
                "psycopg_tuples": psycopg_tuples,
                "psycopg_copy_raw": psycopg_copy_raw,
            }
            try:
                import connectorx as _  # type: ignore[import-not-found,unused-ignore]  # noqa: F401

                candidates["connectorx"] = connectorx
            except ImportError:
                common.log("connectorx is not installed: skipped")
            times: dict[str, list[float]] = {name: [] for name in candidates}
            cpu: dict[str, list[float]] = {name: [] for name in candidates}
            for rep in range(args.reps + 1):
                for name in common.rotated(list(candidates), rep):
                    started, cpu_started = time.perf_counter(), time.process_time()
                    candidates[name](dsn)
                    if rep:  # the first round warms up
                        times[name].append(time.perf_counter() - started)
                        cpu[name].append(time.process_time() - cpu_started)
            base = common.median(times["adbc"])
            for name, values in times.items():
                figure: dict[str, Any] = {
                    "figure": "reader",
                    "reader": name,
                    "rows": args.rows,
                    "median_s": common.rnd(common.median(values), 3),
                    "rows_per_s": round(args.rows / common.median(values)),
                    "adbc_time_over_this": common.rnd(base / common.median(values), 3),
                    "client_cpu_s": common.rnd(common.median(cpu[name]), 3),
                }
                common.emit(figure)

    asyncio.run(run())


# --smoke: the smallest sizes that still go through every step.
SMOKE = ["--rows", "2000", "--reps", "1"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--reps", type=int, default=5)
    main(common.parse(parser, SMOKE))
