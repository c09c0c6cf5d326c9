"""The README's minimal example really runs: two writer processes and a worker, which
prints each of the ten notes once."""

from __future__ import annotations

import ast
import asyncio
import os
import sys
from pathlib import Path

import pace
from plait.ports import free_port

EXAMPLE = Path(__file__).parent.parent / "examples" / "minimal.py"


async def test_the_minimal_example_delivers_every_note_once(dsn: str) -> None:
    env = {**os.environ, "PLAIT_DSN": dsn, "HUB": str(free_port()), "STAY": "20"}

    async def start(name: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, str(EXAMPLE), name, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip

    assert len(EXAMPLE.read_text().splitlines()) <= 43
    # A reader gets the rows written after it started: the worker first, then writers.
    worker = await start("worker")
    assert worker.stdout is not None
    first = await pace.wait(worker.stdout.readline(), 60, "the worker to say it started")
    assert first.decode().strip() == "worker started"
    writers = [await start("w1"), await start("w2")]
    try:
        try:
            out, err = await pace.wait(
                worker.communicate(), 60, "the worker to get ten notes and end"
            )
        except TimeoutError as late:
            worker.kill()
            for process in writers:
                if process.returncode is None:
                    process.terminate()
            said = [await p.communicate() for p in (worker, *writers)]
            raise AssertionError(
                f"{late}; what each process said:\n"
                + "\n".join(
                    f"{n}: {o.decode()}{e.decode()[-3000:]}"
                    for n, (o, e) in zip(("worker", "w1", "w2"), said, strict=True)
                )
            ) from None
        assert worker.returncode == 0, err.decode()
        assert "has no index" not in err.decode()  # the example makes the one it needs
        notes = [
            note
            for line in out.decode().splitlines()
            for note in ast.literal_eval(line.split(" ", 2)[2])
        ]
        expected = [f"{w}: note {i}" for w in ("w1", "w2") for i in range(5)]
        assert sorted(notes) == sorted(expected)  # each once
        for w in ("w1", "w2"):  # in order per writer
            assert [n for n in notes if n.startswith(w)] == [e for e in expected if e.startswith(w)]
    finally:
        for process in writers:
            if process.returncode is None:
                process.terminate()
            await process.wait()
