"""No password or secret reaches a log record or an error message a user is shown:
not the database password in a DSN, not a Redis password in a URL, not the internal
API's bearer secret, not a wrong secret someone tried. Everything runs for real (a
PostgreSQL with trust auth takes any password) and every logger records at DEBUG."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import pytest
from psycopg.conninfo import make_conninfo

import pace
from http_api_helpers import Counter, MakeClient
from plait import ConfigError, Database, DatabaseUnavailableError
from plait.config import InstanceConfig
from plait.core.redact import redact
from plait.errors import RemoteCallError
from plait.instance import Instance
from plait.ports import free_port
from plait.replication.http_api import PREFIX

pytestmark = pytest.mark.timeout(60)

PG_PASSWORD = "pg-pass-7Qx"
REDIS_PASSWORD = "redis-pass-9Zk"
HTTP_SECRET = "http-secret-4Wm"
WRONG_SECRET = "wrong-secret-2Jd"
SECRETS = (PG_PASSWORD, REDIS_PASSWORD, HTTP_SECRET, WRONG_SECRET)


def _leaks(text: str) -> list[str]:
    return [secret for secret in SECRETS if secret in text]


def _with_password(redis_url: str) -> str:
    parts = urlsplit(redis_url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"nobody:{REDIS_PASSWORD}@{host}:{parts.port or 6379}"
    return urlunsplit(parts._replace(netloc=netloc))


async def test_no_secret_reaches_the_logs_or_the_errors(
    dsn: str,
    redis_url: str,
    make_client: MakeClient,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    database = make_conninfo(dsn, password=PG_PASSWORD)
    ports = {"a": free_port(), "b": free_port()}
    hub_port = free_port()

    def config(name: str, **extra: Any) -> dict[str, Any]:
        return {
            "instance_name": name,
            "database": database,
            "streams": [{"name": "typing", "kind": "memory", "writers": ["a"]}],
            "instance_map": {n: f"http://127.0.0.1:{p}" for n, p in ports.items()},
            "http": {"port": ports.get(name, 0), "secret": HTTP_SECRET},
            "replication": {"transport": "tcp", "tcp": {"hub": "a", "port": hub_port}},
            **extra,
        }

    errors: list[str] = []
    a, b = Instance(config("a")), Instance(config("b"))
    a.register_endpoint("echo", Counter())
    # Its Redis refuses the password: the transport logs each failed attempt.
    c = Instance(
        config(
            "c",
            http={"enabled": False},
            replication={"transport": "redis", "redis": {"url": _with_password(redis_url)}},
        )
    )
    async with a, b, c:
        assert await b.call("a", "echo", {"x": 1}) == {"echo": {"x": 1}, "run": 1}

        # Wrong secrets, from a client library and by hand.
        intruder = make_client(
            {"a": f"http://127.0.0.1:{ports['a']}"},
            instance_name="intruder",
            secret=WRONG_SECRET,
            retry_for=0.0,
        )
        with pytest.raises(RemoteCallError, match="401") as refused:
            await intruder.call("a", "echo", 1)
        errors.append(str(refused.value))
        for header in (f"Bearer {WRONG_SECRET}", f"Basic {HTTP_SECRET}", WRONG_SECRET):
            url = f"http://127.0.0.1:{ports['a']}{PREFIX}/call/echo/t1"
            async with http.post(url, json={}, headers={"Authorization": header}) as response:
                assert response.status == 401
                errors.append(await response.text())

        # c's failed attempts are logged with its Redis URL, masked (its "not signed"
        # warning comes first, and names no URL).
        await pace.until(
            lambda: any(
                "redis transport" in r.getMessage() and "redis://" in r.getMessage()
                for r in caplog.records
            ),
            10,
            "a log record of c's Redis transport naming its URL",
        )

    assert caplog.records
    leaked = {
        f"{record.name}: {record.getMessage()[:200]}": _leaks(text)
        for record in caplog.records
        if _leaks(text := record.getMessage() + caplog.handler.format(record))
    }
    leaked.update({error[:200]: _leaks(error) for error in errors if _leaks(error)})
    assert not leaked
    # The records that name a URL or DSN show it masked, not left out.
    redis_records = [r.getMessage() for r in caplog.records if "redis transport" in r.getMessage()]
    assert any(":***@" in message for message in redis_records), redis_records


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://u:{PG_PASSWORD}@[::1/x",
        f"postgresql://u:{PG_PASSWORD}@127.0.0.1:1/db",
        f"host=127.0.0.1 password={PG_PASSWORD} bogus=1",
        f"password='{PG_PASSWORD}",
    ],
    ids=["bad-uri", "no-server", "bad-option", "unterminated"],
)
async def test_a_dsn_refused_is_shown_with_its_password_masked(dsn: str) -> None:
    """libpq quotes some DSNs back in its complaint; the user sees them, masked."""
    with pytest.raises(DatabaseUnavailableError) as failed:
        await Database.connect(dsn)
    assert not _leaks(str(failed.value))
    assert "***" in str(failed.value)


@pytest.mark.parametrize(
    "changes",
    [
        {"fence_after": "soon"},
        {"http": {"secret": HTTP_SECRET, "port": -1}},
        {
            "replication": {
                "transport": "redis",
                "redis": {"url": f"redis://:{REDIS_PASSWORD}@[::1"},
            }
        },
        {"replication": {"transport": "redis", "redis": {"url": f"http://:{REDIS_PASSWORD}@h"}}},
    ],
    ids=["bad-value", "bad-port", "bad-redis-url", "not-redis-url"],
)
def test_a_config_refused_is_shown_without_its_secrets(changes: dict[str, Any]) -> None:
    value = {
        "instance_name": "d",
        "database": f"postgresql://u:{PG_PASSWORD}@127.0.0.1/db",
        "http": {"secret": HTTP_SECRET},
        **changes,
    }
    with pytest.raises(ConfigError) as invalid:
        InstanceConfig.load(value)
    assert not _leaks(str(invalid.value))


def test_a_config_file_value_yaml_cannot_read_is_not_quoted(tmp_path: Path) -> None:
    path = tmp_path / "plait.yaml"
    path.write_text(
        f"instance_name: d\nreplication:\n  redis:\n    password: !!int {REDIS_PASSWORD}\n"
    )
    with pytest.raises(ConfigError) as invalid:
        InstanceConfig.from_yaml(path)
    assert "could not be read" in str(invalid.value)
    assert not _leaks(str(invalid.value))


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql://u:pw@host:5432/db", "postgresql://u:***@host:5432/db"),
        ("postgresql://u@host/db", "postgresql://u@host/db"),
        ("redis://:p@ss@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://host/0?password=pw&db=1", "redis://host/0?password=***&db=1"),
        ("host=h password=pw port=5", "host=h password=*** port=5"),
        ("host=h password = 'p w\\'x' port=5", "host=h password = *** port=5"),
        ("password='unterminated", "password=***"),
        ("host=h sslpassword=pw", "host=h sslpassword=***"),
        ("host=h nopassword=pw", "host=h nopassword=pw"),
        ('in URI: "postgresql://u:pw@[::1/x"', 'in URI: "postgresql://u:***@[::1/x"'),
    ],
)
def test_passwords_are_masked_in_any_text(text: str, shown: str) -> None:
    assert redact(text) == shown


def test_the_cli_shows_a_dsn_that_does_not_parse_masked() -> None:
    # libpq quotes a DSN it cannot parse back in its error, password and all.
    result = pace.run(
        [sys.executable, "-m", "plait.cli", "status", "--dsn", "postgresql://u:sekrit@[::1"],
        60,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "sekrit" not in result.stdout + result.stderr
    assert "postgresql://u:***@[::1" in result.stderr
