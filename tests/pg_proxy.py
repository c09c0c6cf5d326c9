"""The checker's fault proxy in front of a test's PostgreSQL: the only way to make "did
it commit?" happen on demand, or a network partition, without a mock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from plait.check.proxy import CutProxy


@asynccontextmanager
async def proxy_in_front(dsn: str) -> AsyncIterator[tuple[CutProxy, str]]:
    """A proxy in front of `dsn`'s server (host and port), and a DSN through it."""
    params = conninfo_to_dict(dsn)
    host, port = str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)
    proxy = CutProxy(0, port, target_host=host)
    await proxy.start()
    try:
        yield proxy, make_conninfo(dsn, host="127.0.0.1", port=str(proxy.port))
    finally:
        await proxy.stop()


answer_losing_proxy = proxy_in_front
