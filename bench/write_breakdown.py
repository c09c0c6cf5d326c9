"""Where the write path's time goes: plait against plain psycopg doing what plait does.

Diagnostic companion of `write_path.py` (same worker processes, same alternation). For
single-row writes (and `--batch` for 100-row batches) it measures, relative to the bare
autocommit INSERT:
- `bare_txn`: the bare INSERT inside an explicit BEGIN/COMMIT (3 round trips);
- `bare_txn_pipelined`: BEGIN and the INSERT in one psycopg pipeline, then COMMIT (2
  round trips: what `db.transaction()` sends since it pipelines BEGIN);
- `emul_nextval_txn`: plait's SQL without plait: `SELECT nextval` on one pooled
  connection, then BEGIN / INSERT / COMMIT on another (4 round trips);
- `emul_nextval_pipelined_txn`: the same with BEGIN pipelined with the INSERT (3);
- `emul_nextval_txn_upsert_pipelined`: `emul_nextval_txn` plus a background upsert of
  the writer's position after every write, each sent the way plait's
  `StreamStore.upsert_position` sends one (pipeline: BEGIN, SET LOCAL synchronous_commit
  TO off, INSERT ... ON CONFLICT DO UPDATE, COMMIT), with no coalescing;
- `emul_nextval_txn_upsert_1rt`: the same with each upsert as one autocommit statement
  on a dedicated connection whose session has synchronous_commit off;
- `plait_get_next`, `plait_get_next_txn`: plait as documented;
- `plait_get_next_no_upserts`, `plait_get_next_txn_no_upserts`: plait with its position
  writer's poke after each write muted in the benchmark process (diagnostic only: the
  periodic flush still runs; plait's source is untouched).

Run: python bench/write_breakdown.py [--quick] [--dsn DSN] [--batch]
"""

from __future__ import annotations

import argparse
import sys

from common import add_common_args, emit, median, parse, rnd, run
from write_path import BATCH, Tally, run_groups

VARIANTS = (
    "bare",
    "bare_txn",
    "bare_txn_pipelined",
    "emul_nextval_txn",
    "emul_nextval_pipelined_txn",
    "emul_nextval_txn_upsert_pipelined",
    "emul_nextval_txn_upsert_1rt",
    "plait_get_next",
    "plait_get_next_no_upserts",
    "plait_get_next_txn",
    "plait_get_next_txn_no_upserts",
)


def report(writers: int, n: int, reps: int, phase_s: float, tallies: dict[str, Tally]) -> None:
    bare = median(tallies["bare"].samples)
    for variant, tally in tallies.items():
        rate = median(tally.samples)
        emit(
            {
                "bench": "write_breakdown",
                "writers": writers,
                "rows_per_txn": n,
                "variant": variant,
                "rows_per_s": rnd(rate, 1),
                "ratio_vs_bare": rnd(rate / bare, 3),
                "round_trips_per_write": tally.per_write(),
                "client_cpu_us_per_write": tally.cpu_us_per_write(),
                "server_cpu_us_per_write": tally.server_cpu_us_per_write(),
                "position_upserts_per_write": rnd(tally.upserts / max(tally.writes, 1), 3),
                "reps": reps,
                "phase_s": phase_s,
                "samples": [rnd(s, 1) for s in tally.samples],
            }
        )


async def main(args: argparse.Namespace) -> None:
    timing = (
        args.reps or (3 if args.quick else 5),
        args.phase or (0.2 if args.quick else 1.0),
        0.1 if args.quick else 0.3,
    )
    shapes = [BATCH] if args.batch else [1]
    await run_groups(args, "breakdown", shapes, VARIANTS, timing, report)


# --smoke: the smallest sizes that still go through every step.
SMOKE = ["--quick", "--reps", "1", "--phase", "0.05"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--reps", type=int, default=0, help="repetitions per variant")
    parser.add_argument("--phase", type=float, default=0.0, help="seconds per phase")
    parser.add_argument("--batch", action="store_true", help=f"{BATCH}-row batches instead")
    parser.add_argument(
        "--writers", type=int, nargs="+", default=[1, 4], help="writer process counts"
    )
    return parse(parser, SMOKE, argv)


if __name__ == "__main__":
    run(main, parse_args(sys.argv[1:]))
