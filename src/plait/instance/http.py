"""Starting an instance's internal HTTP API on its address, with a refusal that names the
setting to change when the address cannot be had."""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from plait.config import InstanceConfig
from plait.errors import ConfigError
from plait.replication.http_api import EndpointHandler
from plait.replication.http_server import InternalApi
from plait.replication.metrics import ReplicationMetrics
from plait.streams.memory import ReadPage


async def start_api(
    config: InstanceConfig,
    endpoints: Mapping[str, EndpointHandler],
    *,
    catch_up: Callable[[str, int, int, int], Awaitable[ReadPage]],
    own_positions: Callable[[], dict[str, int]],
    await_positions: Callable[..., Awaitable[Any]],
    metrics: ReplicationMetrics,
) -> InternalApi:
    """The API with `endpoints`, listening. `ConfigError` when the address is in use
    (naming whoever `instance_map` gives it to) or not ours to listen on."""
    name = config.instance_name
    api = InternalApi(
        instance_name=name,
        secret=config.http.secret_value(),
        catch_up=catch_up,
        own_positions=own_positions,
        await_positions=await_positions,
        metrics=metrics,
    )
    for endpoint, handler in endpoints.items():
        api.register(endpoint, handler)
    host, port, setting = config.http_address()
    try:
        await api.start(host, port)
    except OSError as err:
        if err.errno != errno.EADDRINUSE:  # not allowed (a port below 1024), no such address
            raise ConfigError(
                f"instance {name!r} cannot listen on {host}:{port} ({setting}, "
                f"http.host): {err.strerror or err}"
            ) from None
        holders = config.holders_of(port)
        who = f"; instance_map gives it to {', '.join(holders)}" if holders else ""
        fix = (
            "give each instance its own address in instance_map (the file's http.port "
            "is the same for all)"
            if setting == "http.port"
            else "stop the process that holds it, or change the address"
        )
        raise ConfigError(
            f"instance {name!r} cannot listen on {host}:{port} ({setting}): the "
            f"address is in use{who}. Does this instance run already? Else {fix}"
        ) from None
    return api
