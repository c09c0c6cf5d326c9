"""Four writer processes, a per-writer token reader and a linear reader, then a restart.

Writers commit out of order with random delays (some over a second) and random
rollbacks. Both readers must see every committed row exactly once and no rolled-back
row; after all writers restart, positions, tokens and IDs carry on with no reuse.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import pace
from plait import Database, MultiWriterIdGenerator, StreamSpec, StreamToken, TableSpec
from plait.check.plan import read_control, write_control
from stream_helpers import create_table, stored_positions

ROLES = Path(__file__).with_name("mp_roles.py")
WRITERS = ["w0", "w1", "w2", "w3"]

pytestmark = pytest.mark.slow


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def set_control(path: Path, **values: Any) -> None:
    write_control(path, {**read_control(path), **values})


async def spawn(role: str, args: dict[str, Any]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROLES),
        role,
        json.dumps(args),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


async def wait_for_event(
    paths: list[Path], event: str, seconds: float, procs: list[asyncio.subprocess.Process]
) -> None:
    """Until each file of `paths` has an `event`, for `seconds` at this machine's pace."""
    limit = pace.scaled(seconds)
    deadline = asyncio.get_running_loop().time() + limit
    while asyncio.get_running_loop().time() < deadline:
        if all(any(e["event"] == event for e in read_events(p)) for p in paths):
            return
        for proc in procs:
            if proc.returncode not in (None, 0):
                assert proc.stderr is not None
                raise AssertionError((await proc.stderr.read()).decode()[-3000:])
        await asyncio.sleep(0.1)
    raise AssertionError(f"waited {limit:.1f} s for {event!r} from {paths}")


async def finish(procs: list[asyncio.subprocess.Process], seconds: float = 60) -> None:
    for proc in procs:
        try:
            await pace.wait(proc.wait(), seconds, f"process {proc.pid} to end")
        except TimeoutError:
            proc.kill()
            raise
        assert proc.stderr is not None
        err = (await proc.stderr.read()).decode()
        assert proc.returncode == 0, err[-3000:]


async def run_writers(
    dsn: str, tmp: Path, phase: int, writes: int, control: Path
) -> tuple[list[asyncio.subprocess.Process], list[Path]]:
    outs = [tmp / f"writer-{phase}-{name}.jsonl" for name in WRITERS]
    procs = [
        await spawn(
            "writer",
            {
                "dsn": dsn,
                "name": name,
                "writers": WRITERS,
                "writes": writes,
                "seed": phase * 100 + i,
                "slow_fraction": 0.06,
                "out": str(out),
                "control": str(control),
            },
        )
        for i, (name, out) in enumerate(zip(WRITERS, outs, strict=True))
    ]
    return procs, outs


async def test_four_writer_processes_two_readers_and_a_restart(
    db: Database, dsn: str, tmp_path: Path
) -> None:
    await create_table(db)
    control = tmp_path / "control.json"
    set_control(control, writers_stop=False)
    reader_outs = {mode: tmp_path / f"reader-{mode}.jsonl" for mode in ("token", "linear")}
    readers = [
        await spawn(
            "reader",
            {
                "dsn": dsn,
                "mode": mode,
                "writers": WRITERS,
                "out": str(out),
                "control": str(control),
            },
        )
        for mode, out in reader_outs.items()
    ]
    await wait_for_event(list(reader_outs.values()), "start", 60, readers)

    # Phase 1: four writers, then they idle until told to stop.
    writers, outs = await run_writers(dsn, tmp_path, 1, 60, control)
    await wait_for_event(outs, "done", 120, writers + readers)
    observer = await MultiWriterIdGenerator.create(
        db, StreamSpec("events", tables=[TableSpec("events")], writers=WRITERS), "observer"
    )
    await observer.refresh_positions()
    token_before = StreamToken.from_generator(observer)
    set_control(control, writers_stop=True)
    await finish(writers)
    phase1 = [e for out in outs for e in read_events(out)]
    stored_before = await stored_positions(db)
    allocated_before = {e["id"] for e in phase1 if e["event"] in ("committed", "rolled_back")}

    # Phase 2: every writer restarts and carries on.
    set_control(control, writers_stop=False)
    writers, outs = await run_writers(dsn, tmp_path, 2, 30, control)
    await wait_for_event(outs, "done", 120, writers + readers)
    phase2 = [e for out in outs for e in read_events(out)]
    for name, out in zip(WRITERS, outs, strict=True):
        start = next(e for e in read_events(out) if e["event"] == "start")
        assert start["positions"][name] >= stored_before[name], (name, start, stored_before)
        assert start["own"] >= max(stored_before.values())
    allocated_after = {e["id"] for e in phase2 if e["event"] in ("committed", "rolled_back")}
    assert min(allocated_after) > max(allocated_before)  # no ID reused
    await observer.refresh_positions()
    assert token_before.is_before_or_eq(StreamToken.from_generator(observer))

    committed = [e["id"] for e in phase1 + phase2 if e["event"] == "committed"]
    rolled_back = {e["id"] for e in phase1 + phase2 if e["event"] == "rolled_back"}
    assert rolled_back, "the run should include rollbacks"
    assert len(committed) == len(set(committed))
    set_control(control, stop_at=max(allocated_before | allocated_after))
    await finish(readers, seconds=90)
    set_control(control, writers_stop=True)
    await finish(writers)

    for mode, out in reader_outs.items():
        events = read_events(out)
        assert not [e for e in events if e["event"] == "regression"], mode
        seen = next(e["ids"] for e in events if e["event"] == "seen")
        duplicates = [i for i, n in Counter(seen).items() if n > 1]
        assert not duplicates, (mode, duplicates)
        assert not set(seen) & rolled_back, mode
        assert set(seen) == set(committed), (mode, sorted(set(committed) ^ set(seen))[:20])
