"""An application for `plait serve --app serve_app:setup` (tests/test_serve.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from plait.instance import Instance


def setup(instance: Instance) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        await instance.generator("events").insert(
            "INSERT INTO events (stream_id, instance_name, payload)"
            " VALUES ({id}, %s, 'from the app') RETURNING stream_id",
            (instance.name,),
        )
        await asyncio.Event().wait()  # until the instance stops

    return run
