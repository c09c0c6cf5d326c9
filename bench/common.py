"""Shared helpers for the benchmark scripts in this folder (not a test module).

Every benchmark script:
- takes `--dsn` (else `$PLAIT_BENCH_DSN`, else the machine's PostgreSQL at
  `DEFAULT_DSN`), and falls back to plait's embedded server only when that one does not
  answer;
- works in a schema of its own (through `search_path` in the DSN) and drops it at the end;
- prints one JSON line per figure on stdout; progress goes to stderr.

Scripts import this module as `common` (Python puts the script's folder first on
`sys.path`, and spawned worker processes inherit that path).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.waiting import Wait

from plait import Database

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
DSN_ENV = "PLAIT_BENCH_DSN"

T = TypeVar("T")


# The events table every write benchmark measures on (its stream's one table).
EVENTS_DDL = (
    "CREATE TABLE events (stream_id BIGINT NOT NULL, instance_name TEXT NOT NULL,"
    " payload TEXT); CREATE INDEX ON events (instance_name, stream_id)"
)


def log(message: str) -> None:
    """Progress for humans, on stderr (stdout carries only the JSON lines)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def emit(figure: dict[str, Any]) -> None:
    """One figure as one JSON line on stdout, with the machine's load when it was taken
    (other processes compete for the same 2 cores: a high load means a noisier figure)."""
    figure = {**figure, "load_avg_1m": round(os.getloadavg()[0], 2)}
    if SMOKE:
        figure["smoke"] = True  # sizes too small to mean anything
    print(json.dumps(figure, sort_keys=False), flush=True)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dsn",
        default=None,
        help=f"PostgreSQL to measure on (default: ${DSN_ENV}, else {DEFAULT_DSN}; "
        "the embedded server if that does not answer)",
    )
    parser.add_argument("--quick", action="store_true", help="a short run (about 20 s)")
    add_smoke_arg(parser)


def add_smoke_arg(parser: argparse.ArgumentParser) -> None:
    """--smoke, for a script that needs no database (`add_common_args` adds it too)."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run that goes through every step, in seconds: CI's check that "
        "the script still works (its figures mean nothing, and say so)",
    )


# Set by `parse` for a --smoke run: every figure says it is one (`emit`).
SMOKE = False


def parse(
    parser: argparse.ArgumentParser, smoke: Sequence[str], argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """The script's options. With --smoke, the script's `smoke` options (its smallest
    sizes) come first, so that any option given on the command line still wins."""
    global SMOKE
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    if args.smoke:
        SMOKE = True
        args = parser.parse_args([*smoke, *given])
    return args


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0.99: p99) of `values`, by nearest rank (never interpolated)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def rnd(value: float, digits: int = 4) -> float:
    """Round for the JSON output (keeps lines short; the raw samples are listed too)."""
    return round(value, digits)


def with_search_path(dsn: str, schema: str) -> str:
    """`dsn` with `search_path` set to `schema` on every connection made from it."""
    params = conninfo_to_dict(dsn)
    options = str(params.get("options", "") or "")
    params["options"] = f"{options} -c search_path={schema}".strip()
    return make_conninfo("", **params)


async def _answers(dsn: str) -> bool:
    try:
        conn = await AsyncConnection.connect(dsn, connect_timeout=5, autocommit=True)
    except psycopg.Error as err:
        log(f"PostgreSQL at the benchmark DSN does not answer: {str(err).strip()[:200]}")
        return False
    await conn.close()
    return True


@contextlib.asynccontextmanager
async def server(dsn_arg: str | None) -> AsyncIterator[str]:
    """The DSN of the server to measure on (the embedded one only as a fallback)."""
    dsn = dsn_arg or os.environ.get(DSN_ENV) or DEFAULT_DSN
    if await _answers(dsn):
        yield dsn
        return
    log("falling back to plait's embedded PostgreSQL (Database.connect(dsn=None))")
    embedded = await Database.connect(None, min_size=1, max_size=1)
    try:
        yield embedded.dsn
    finally:
        await embedded.close()


@contextlib.asynccontextmanager
async def bench_schema(server_dsn: str, name: str) -> AsyncIterator[str]:
    """A fresh schema `bench_<name>_<random>`; yields a DSN whose search_path is it."""
    schema = f"bench_{name}_{uuid.uuid4().hex[:8]}"
    async with await AsyncConnection.connect(server_dsn, autocommit=True) as conn:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    log(f"schema {schema}")
    try:
        yield with_search_path(server_dsn, schema)
    finally:
        async with await AsyncConnection.connect(server_dsn, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        log(f"dropped schema {schema}")


async def server_info(dsn: str) -> dict[str, Any]:
    """What the figures depend on: server version and durability settings, cores."""
    async with await AsyncConnection.connect(dsn, autocommit=True) as conn:
        info: dict[str, Any] = {"cores": os.cpu_count()}
        for setting in ("server_version", "fsync", "synchronous_commit", "wal_sync_method"):
            row = await (await conn.execute(f"SHOW {setting}")).fetchone()
            info[setting] = row[0] if row else None
    return info


# -- server CPU (when the server runs on this machine) ---------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces.
    return text[text.rindex(")") + 2 :].split()


async def find_postmaster(conn: AsyncConnection[Any]) -> int | None:
    """The server's main process id, if the server runs on this machine (else None)."""
    row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
    fields = _stat_fields(int(row[0])) if row else None
    if fields is None:
        return None
    parent = int(fields[1])
    return parent if _stat_fields(parent) is not None else None


def server_cpu_seconds(postmaster: int | None) -> float | None:
    """User + system CPU of the server's main process and all its children so far
    (backends that have exited too: a client that connects per task leaves none)."""
    return None if postmaster is None else sum(tree_cpu_seconds(postmaster))


def child_named(name: str, parent: int | None = None) -> int | None:
    """A child process of `parent` (default: this one) running `name` (Spark's JVM:
    `java`)."""
    parent = os.getpid() if parent is None else parent
    for entry in os.listdir("/proc"):
        fields = _stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[1]) == parent:
            with contextlib.suppress(OSError), open(f"/proc/{entry}/comm") as f:
                if f.read().strip() == name:
                    return int(entry)
    return None


def tree_cpu_seconds(root: int) -> tuple[float, float]:
    """User + system CPU of `root` itself, and of its descendants, live or exited
    (their parents' counts of reaped children)."""
    fields = {int(e): f for e in os.listdir("/proc") if e.isdigit() and (f := _stat_fields(int(e)))}
    children: dict[int, list[int]] = {}
    for pid, f in fields.items():
        children.setdefault(int(f[1]), []).append(pid)
    own, below, todo = 0, 0, [root]
    while todo:
        pid = todo.pop()
        f = fields.get(pid)
        if f is None:
            continue
        below += int(f[13]) + int(f[14])  # cutime, cstime: reaped children
        if pid == root:
            own = int(f[11]) + int(f[12])  # utime, stime
        else:
            below += int(f[11]) + int(f[12])
        todo.extend(children.get(pid, []))
    ticks = os.sysconf("SC_CLK_TCK")
    return own / ticks, below / ticks


async def timed(step: Callable[[], Awaitable[T]]) -> tuple[float, T]:
    start = time.perf_counter()
    result = await step()
    return time.perf_counter() - start, result


def rotated(items: Sequence[T], by: int) -> list[T]:
    """`items` rotated by `by`: alternating orders so no variant always runs first."""
    k = by % len(items) if items else 0
    return [*items[k:], *items[:k]]


# -- round-trip accounting ------------------------------------------------------------------

ROUND_TRIPS: Counter[str] = Counter()


def _task_kind() -> str:
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return "other"
    name = task.get_name() if task is not None else ""
    if name.startswith("plait-positions"):
        return "positions"
    if name.startswith("plait-id-allocator"):
        return "allocator"
    return "caller"


def _observe(gen: Generator[Any, Any, Any], kind: str) -> Generator[Any, Any, Any]:
    """Forward psycopg generator `gen`, counting one round trip per blocking read."""
    try:
        state = next(gen)
    except StopIteration as stop:
        return stop.value
    while True:
        if state == Wait.R:
            ROUND_TRIPS[kind] += 1
        try:
            ready = yield state
        except BaseException as exc:
            try:
                state = gen.throw(exc)
            except StopIteration as stop:
                return stop.value
            continue
        try:
            state = gen.send(ready)
        except StopIteration as stop:
            return stop.value


def count_round_trips() -> None:
    """Count round trips to the server made by psycopg async connections in this process.

    A round trip is a wait for the server to answer (a blocking read: each execute,
    BEGIN or COMMIT outside a pipeline; each sync of a pipeline). Counts are kept by the
    asyncio task that made them: `positions` (plait's background position upserts and
    refreshes), `allocator` (plait's shared `SELECT nextval` round trips) and `caller`
    (everything else: the benchmark's own transactions, `get_next_txn`'s nextval).
    """
    if getattr(AsyncConnection.wait, "_bench_counted", False):
        return
    original = AsyncConnection.wait

    async def wait(self: AsyncConnection[Any], gen: Any, *args: Any, **kwargs: Any) -> Any:
        return await original(self, _observe(gen, _task_kind()), *args, **kwargs)

    wait._bench_counted = True  # type: ignore[attr-defined]
    AsyncConnection.wait = wait  # type: ignore[method-assign]


def round_trip_snapshot() -> dict[str, int]:
    return dict(ROUND_TRIPS)


def round_trip_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    keys = set(before) | set(after)
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys)}


def run(
    main: Callable[[argparse.Namespace], Coroutine[Any, Any, None]], args: argparse.Namespace
) -> None:
    """Run a benchmark's `main`; a database error ends it with a one-line message."""
    try:
        asyncio.run(main(args))
    except psycopg.Error as err:
        log(f"database error: {err}")
        sys.exit(1)
