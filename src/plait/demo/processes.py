"""The demo's processes: each role of the chat service as `plait serve --app
plait.demo.roles:<role>` with a configuration file of its own, started in order (the
hub first) and stopped with SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
import time
from pathlib import Path

import aiohttp
import yaml

from plait.demo import schema
from plait.demo.roles import SYNC_PORT_ENV
from plait.ports import free_port

EVENT_WRITERS = ["ev1", "ev2"]
ROLES = {
    "main": "main",
    "ev1": "event_writer",
    "ev2": "event_writer",
    "bg": "background",
    "sync1": "sync_worker",
}


class Processes:
    """The service's processes: started in order, each once it answers; stopped with
    SIGTERM (gracefully), killed if one takes longer than 15 s."""

    def __init__(self, dsn: str, redis: str | None, logs: Path) -> None:
        self.dsn, self.redis, self.logs = dsn, redis, logs
        self.ports = {name: free_port() for name in ROLES}
        self.sync_port = free_port()
        self.hub_port = free_port()
        # One per run, for the internal HTTP API and replication alike: the processes
        # prove it to each other (and Redis lines are signed with it).
        self.secret = secrets.token_hex(16)
        self.running: dict[str, asyncio.subprocess.Process] = {}

    @property
    def sync_url(self) -> str:
        return f"http://127.0.0.1:{self.sync_port}"

    @property
    def api_urls(self) -> dict[str, str]:
        """Each process's internal HTTP API (its instance_map)."""
        return {name: f"http://127.0.0.1:{port}" for name, port in self.ports.items()}

    def metrics_url(self, name: str) -> str:
        return f"{self.api_urls[name]}/metrics"

    async def start(self) -> None:
        for name in ROLES:  # main first: it is the hub
            await self._start(name)
            await self._ready(self.metrics_url(name), name)
        await self._ready(f"{self.sync_url}/sync?user=ready", "sync1")

    async def _start(self, name: str) -> None:
        config = schema.config_dict(
            name,
            database=self.dsn,
            event_writers=EVENT_WRITERS,
            http_ports=self.ports,
            secret=self.secret,
            redis=self.redis,
            hub_port=self.hub_port,
        )
        path = self.logs / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        log = (self.logs / f"{name}.log").open("ab")
        env = {**os.environ, SYNC_PORT_ENV: str(self.sync_port)}
        self.running[name] = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "plait.cli", "serve", "--config", str(path),
            "--app", f"plait.demo.roles:{ROLES[name]}", "--log-level", "info",
            stdout=log, stderr=log, env=env, start_new_session=True,
        )  # fmt: skip
        log.close()

    async def _ready(self, url: str, name: str, within: float = 60.0) -> None:
        deadline = time.monotonic() + within
        async with aiohttp.ClientSession() as session:
            while True:
                process = self.running[name]
                if process.returncode is not None:
                    raise RuntimeError(
                        f"process {name} exited with status {process.returncode}; "
                        f"see {self.logs / (name + '.log')}"
                    )
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(url) as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"process {name} did not answer at {url} in {within:.0f} s")
                await asyncio.sleep(0.1)

    async def stop(self) -> None:
        for name in reversed(list(self.running)):  # the hub last
            process = self.running[name]
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
                try:
                    async with asyncio.timeout(15):
                        await process.wait()
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    await process.wait()
