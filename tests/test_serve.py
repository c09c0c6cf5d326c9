"""`plait serve`: an instance from a YAML file and an application module, serving
metrics, stopped gracefully by SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

import pace
from plait import Database
from stream_helpers import create_table


async def _deployment_file(db: Database, tmp_path: Path) -> Path:
    """A configuration file for one stream `events` written by w1 (its table made)."""
    await create_table(db)
    config = {
        "instance_name": "placeholder",
        "streams": [{"name": "events", "tables": [{"name": "events"}], "writers": ["w1"]}],
        "http": {"port": 0},
    }
    path = tmp_path / "plait.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def _until_serving(stderr: asyncio.StreamReader) -> str:
    """What `plait serve` logged up to the line saying it is serving."""
    log = ""
    while "serving" not in log:
        line = await pace.wait(stderr.readline(), 60, "plait serve to say it is serving")
        assert line, f"plait serve exited early: {log}"
        log += line.decode()
    return log


async def test_serve_runs_the_app_serves_metrics_and_stops_on_sigterm(
    db: Database, tmp_path: Path
) -> None:
    path = await _deployment_file(db, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "PLAIT_DSN": db.dsn}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "plait.cli", "serve", "--config", str(path),
        "--instance-name", "w1", "--app", "serve_app:setup",
        stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        log = await _until_serving(proc.stderr)
        url = re.search(r"metrics at (\S+)/metrics", log)
        assert url is not None, log
        async with aiohttp.ClientSession() as session, session.get(url[1] + "/metrics") as got:
            assert got.status == 200
            assert "plait_" in await got.text()
        rows: list[tuple[Any, ...]] = []

        async def written() -> bool:
            async with db.connection() as conn:
                cur = await conn.execute("SELECT instance_name, payload FROM events")
                rows[:] = await cur.fetchall()
            return bool(rows)

        await pace.until(written, 10, "the app's row", every=0.1)
        assert rows == [("w1", "from the app")]
        proc.send_signal(signal.SIGTERM)
        assert await pace.wait(proc.wait(), 20, "plait serve to stop on SIGTERM") == 0
        rest = (await proc.stderr.read()).decode()
        assert "instance w1 stopped" in rest
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_serve_logs_one_json_object_per_line_when_asked(db: Database, tmp_path: Path) -> None:
    """`--log-format json`: every line of stderr is one JSON object with the instance's
    name, for a log pipeline."""
    path = await _deployment_file(db, tmp_path)
    env = {**os.environ, "PLAIT_DSN": db.dsn}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "plait", "serve", "--config", str(path),
        "--instance-name", "w1", "--log-format", "json",
        stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stderr is not None
    records: list[dict[str, str]] = []
    try:
        while not any("serving" in r["message"] for r in records):
            line = await pace.wait(proc.stderr.readline(), 60, "plait serve to say it is serving")
            assert line, f"plait serve exited early: {records}"
            records.append(json.loads(line))
        proc.send_signal(signal.SIGTERM)
        assert await pace.wait(proc.wait(), 20, "plait serve to stop on SIGTERM") == 0
        records += [json.loads(line) for line in (await proc.stderr.read()).splitlines()]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert all(r["instance"] == "w1" for r in records)
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert any("instance w1 stopped" in r["message"] for r in records)


def test_a_json_log_line_names_the_stream_and_carries_the_error() -> None:
    import logging

    from plait.ops.log_format import JsonLines

    record = logging.LogRecord(
        "plait.x", logging.ERROR, __file__, 1, "stream %s: %s", ("ev", "down"), None
    )
    try:
        raise RuntimeError("broken\nacross lines")
    except RuntimeError:
        record.exc_info = sys.exc_info()
    line = JsonLines("w1").format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert (parsed["stream"], parsed["message"], parsed["level"]) == (
        "ev",
        "stream ev: down",
        "error",
    )
    assert "RuntimeError: broken" in parsed["error"]
    assert parsed["time"].endswith("Z")


async def test_serve_imports_the_app_from_the_working_directory(
    db: Database, tmp_path: Path
) -> None:
    """`plait serve --app my_service:setup`, run from the application's directory with
    the installed `plait` script (whose own path does not hold the working directory)
    and no PYTHONPATH, imports the module from there, as uvicorn and gunicorn do."""
    path = await _deployment_file(db, tmp_path)
    app_dir = tmp_path / "service"
    app_dir.mkdir()
    (app_dir / "my_service.py").write_text((Path(__file__).parent / "serve_app.py").read_text())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PLAIT_DSN"] = db.dsn
    plait = Path(sys.executable).parent / "plait"
    proc = await asyncio.create_subprocess_exec(
        str(plait), "serve", "--config", str(path), "--instance-name", "w1",
        "--app", "my_service:setup", stderr=asyncio.subprocess.PIPE, env=env, cwd=app_dir,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        await _until_serving(proc.stderr)

        async def written() -> bool:
            async with db.connection() as conn:
                cur = await conn.execute("SELECT payload FROM events")
                return await cur.fetchall() == [("from the app",)]

        await pace.until(written, 10, "the app's row", every=0.1)
        proc.send_signal(signal.SIGTERM)
        assert await pace.wait(proc.wait(), 20, "plait serve to stop on SIGTERM") == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
