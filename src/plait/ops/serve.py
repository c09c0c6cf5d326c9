"""`plait serve`: one instance of an application, from its YAML config, until SIGINT or
SIGTERM, then a graceful stop (what is left is sent, the departure announced).

The application's code comes in through `--app module:function`: the function gets the
`Instance` before it starts (to register listeners, commands, endpoints and caches) and
may return an async function, run once the instance is up; when that returns, the
instance stops.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from plait.config import InstanceConfig
from plait.errors import ConfigError
from plait.instance import Instance

logger = logging.getLogger(__name__)

App = Callable[[Instance], Callable[[], Awaitable[Any]] | None]


def load_app(spec: str) -> App:
    """`module:function` as a callable; `ConfigError` saying what is missing."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--app must look like module:function, not {spec!r}")
    # From the working directory first, as uvicorn and gunicorn look: the installed
    # `plait` script's path holds only its own directory, not the application's.
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"--app {spec}: cannot import {module_name!r}: {err}") from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise ConfigError(f"--app {spec}: module {module_name!r} has no function {attr!r}")
    return found  # type: ignore[no-any-return]


async def serve(config: InstanceConfig, app: App | None = None) -> None:
    instance = Instance(config)
    run = app(instance) if app is not None else None
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    try:
        async with instance:
            logger.info(
                "instance %s serving (HTTP %s, metrics at %s/metrics)",
                instance.name,
                instance.http_url or "off",
                instance.http_url or "-",
            )
            waits: list[asyncio.Task[Any]] = [
                asyncio.create_task(stopping.wait(), name="plait-serve-signal")
            ]
            if run is not None:
                waits.append(asyncio.create_task(_run(run), name="plait-serve-app"))
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                task.result()  # the application's failure, if it failed
            logger.info("instance %s stopping", instance.name)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    logger.info("instance %s stopped", instance.name)


async def _run(run: Callable[[], Awaitable[Any]]) -> None:
    await run()
