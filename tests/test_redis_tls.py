"""Redis over TLS (rediss://) and a password kept out of the URL.

Live: a redis-server with TLS on (a client certificate required, a password asked for),
two instances replicating through it with every check on; a wrong CA, a host name not
in the certificate, a missing client certificate each fail with a clear log line and
keep retrying, never hang. Plumbing: what reaches redis-py's client, and the
`ConfigError`s for settings that cannot work. Skipped, saying why, where no certificate
can be made or no redis-server has TLS built in (the plumbing tests then still run).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, SSLConnection

import pace
from pace import scaled
from plait import Database
from plait.config import InstanceConfig, RedisConfig
from plait.errors import ConfigError
from plait.replication.metrics import ReplicationMetrics
from plait.replication.redis_options import RedisTls, client_options
from plait.replication.redis_transport import RedisTransport
from redis_helpers import RecordingHandler, channel, redis_transport
from redis_tls import Pki, TlsRedisServer, make_pki, start_tls_server
from replication_helpers import Seen, cluster_of, start_connected, write
from transport_helpers import RecordingBackoff, eventually

LOGGER = "plait.replication.redis_transport"
PASSWORD = "tls-test-s3cret"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    made = make_pki(tmp_path_factory.mktemp("pki"))
    if isinstance(made, str):
        pytest.skip(f"no TLS certificates for the test: {made}")
    return made


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[TlsRedisServer]:
    """Asks every client for a certificate signed by the test CA, and the password."""
    server = start_tls_server(pki, auth_clients=True, password=PASSWORD)
    if isinstance(server, str):
        pytest.skip(server)
    try:
        yield server
    finally:
        server.close()


def tls_of(pki: Pki, **changes: Any) -> RedisTls:
    """Every check on, with the client certificate."""
    settings: dict[str, Any] = {
        "ca_certs": str(pki.ca),
        "certfile": str(pki.client_cert),
        "keyfile": str(pki.client_key),
    }
    settings.update(changes)
    return RedisTls(**settings)


@pytest.fixture
async def transports() -> AsyncIterator[list[RedisTransport]]:
    made: list[RedisTransport] = []
    yield made
    async with pace.within(10, "the test's transports to stop"):
        for transport in made:
            await transport.stop()


# -- live ----------------------------------------------------------------------------


async def test_two_instances_replicate_over_rediss_with_every_check_on(
    db: Database, tls_server: TlsRedisServer, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    redis = {
        "url": tls_server.url,  # by the name in the certificate
        "password": PASSWORD,
        "ssl_ca_certs": str(pki.ca),
        "ssl_certfile": str(pki.client_cert),
        "ssl_keyfile": str(pki.client_key),
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": True,
    }
    async with cluster_of(db, "redis", redis_url=tls_server.url) as cluster:
        seen_w1, seen_w2 = Seen(), Seen()
        seen = {"w1": seen_w1, "w2": seen_w2}
        w1, w2 = await start_connected(cluster, seen, replication={"redis": redis})
        from_w1 = [await write(w1, f"a{i}") for i in range(5)]
        from_w2 = [await write(w2, f"b{i}") for i in range(5)]
        await seen_w2.wait(5)
        await seen_w1.wait(5)
        await asyncio.sleep(0.2)
        assert [row[1] for row in seen_w2.rows] == from_w1  # each once, in order
        assert [row[1] for row in seen_w1.rows] == from_w2
    assert not any(PASSWORD in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        pytest.param("wrong CA", "certificate verify failed", id="wrong CA"),
        pytest.param("host not in the certificate", "not valid for '127.0.0.1'", id="host name"),
        # the server hangs up after the handshake: what redis-py says varies with OpenSSL
        pytest.param("no client certificate", "ConnectionError", id="no client certificate"),
    ],
)
async def test_a_refused_tls_connection_fails_clearly_and_keeps_retrying(
    case: str,
    expected: str,
    tls_server: TlsRedisServer,
    pki: Pki,
    transports: list[RedisTransport],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    url = tls_server.url
    if case == "wrong CA":
        tls = tls_of(pki, ca_certs=str(pki.other_ca))
    elif case == "host not in the certificate":
        url = url.replace("localhost", "127.0.0.1")
        tls = tls_of(pki)
    else:
        tls = RedisTls(ca_certs=str(pki.ca))
    handler = RecordingHandler("a")
    backoff = RecordingBackoff(initial=0.05, cap=0.2)
    connect_timeout = scaled(2.0)  # three refusals come well within it, unless waited out
    transport = redis_transport(
        handler,
        url,
        channel(),
        tls=tls,
        password=PASSWORD,
        connect_timeout=connect_timeout,
        backoff=backoff,
        metrics=ReplicationMetrics(),
    )
    transports.append(transport)
    started = time.monotonic()
    await transport.start()
    await eventually(lambda: len(backoff.delays) >= 3, "three refused attempts", within=5)
    # refused at once each time: any attempt left to time out would take longer
    assert time.monotonic() - started < connect_timeout
    assert handler.sessions == []
    warnings = [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1, warnings  # one for the streak, the rest at debug level
    assert expected in warnings[0], warnings[0]
    # what to check, when the server's certificate was refused (and only then)
    assert ("ssl_ca_certs" in warnings[0]) == (case != "no client certificate"), warnings[0]
    stopping = time.monotonic()
    await transport.stop()
    assert time.monotonic() - stopping < 0.5


async def test_with_verification_off_the_host_name_and_ca_go_unchecked(
    tls_server: TlsRedisServer, pki: Pki, transports: list[RedisTransport]
) -> None:
    """cert_reqs none (self-signed servers in development): any certificate, any name."""
    handler = RecordingHandler("a")
    url = tls_server.url.replace("localhost", "127.0.0.1")
    tls = tls_of(pki, ca_certs=str(pki.other_ca), cert_reqs="none")
    transport = redis_transport(handler, url, channel(), tls=tls, password=PASSWORD)
    transports.append(transport)
    await transport.start()
    assert await transport.wait_open(scaled(3)), f"not open within {scaled(3):.1f} s"


# -- plumbing ------------------------------------------------------------------------


def pool_of(url: str, **options: Any) -> tuple[type[AbstractConnection], dict[str, Any]]:
    """What redis-py's client is built with: the connection class and its arguments."""
    client = Redis.from_url(url, **options)
    pool = client.connection_pool
    return pool.connection_class, dict(pool.connection_kwargs)


def test_tls_settings_and_the_password_reach_the_redis_client(pki: Pki) -> None:
    tls = tls_of(pki)
    url = "rediss://redis.example:6380/2"
    cls, kwargs = pool_of(url, **client_options(url, tls=tls, password="pw"))
    assert issubclass(cls, SSLConnection)
    assert kwargs["ssl_ca_certs"] == str(pki.ca)
    assert kwargs["ssl_certfile"] == str(pki.client_cert)
    assert kwargs["ssl_keyfile"] == str(pki.client_key)
    assert kwargs["ssl_cert_reqs"] == "required"
    assert kwargs["ssl_check_hostname"] is True
    assert kwargs["password"] == "pw"
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("redis.example", 6380, 2)

    # rediss:// alone verifies against the system's CAs, whatever redis-py's defaults are
    cls, kwargs = pool_of(url, **client_options(url))
    assert issubclass(cls, SSLConnection)
    assert (kwargs["ssl_cert_reqs"], kwargs["ssl_check_hostname"]) == ("required", True)
    assert kwargs["ssl_ca_certs"] is None
    # verification off: no host name check either, unless asked for (which is refused)
    none = client_options(url, tls=RedisTls(cert_reqs="none"))
    assert (none["ssl_cert_reqs"], none["ssl_check_hostname"]) == ("none", False)
    # ssl_* options in the URL's query are redis-py's to apply: none of ours get in the way
    in_url = "rediss://redis.example/0?ssl_cert_reqs=none&ssl_check_hostname=false"
    assert client_options(in_url) == {}
    # a plain URL gets no TLS arguments at all
    cls, kwargs = pool_of("redis://h/0", **client_options("redis://h/0", password="pw"))
    assert not issubclass(cls, SSLConnection)
    assert not any(key.startswith("ssl_") for key in kwargs)
    assert kwargs["password"] == "pw"


def config_of(**redis: Any) -> InstanceConfig:
    # A Redis off this machine carries only signed lines: a secret is needed.
    replication = {"transport": "redis", "redis": redis, "secret": "s"}
    return InstanceConfig.load({"instance_name": "w1", "replication": replication})


def test_the_config_carries_tls_and_a_secret_password(pki: Pki) -> None:
    config = config_of(
        url="rediss://redis.example:6380/0",
        password="hunter2",
        ssl_ca_certs=str(pki.ca),
        ssl_certfile=str(pki.client_cert),
        ssl_keyfile=str(pki.client_key),
    ).replication.redis
    assert config.tls() == tls_of(pki)
    assert config.password_value() == "hunter2"
    for text in (repr(config), str(config), config.model_dump_json()):
        assert "hunter2" not in text
    assert config_of(url="rediss://h/0").replication.redis.tls() is None
    assert RedisConfig().tls() is None
    assert RedisConfig().password_value() is None
    off = config_of(url="rediss://h/0", ssl_cert_reqs="none").replication.redis.tls()
    assert off == RedisTls(cert_reqs="none")


TLS_URL = "rediss://h:6380/0"


def bad_settings(pki: Pki, tmp: Path) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Settings that cannot work, by name: what `InstanceConfig.load` gets, and what its
    error must say."""
    missing = str(tmp / "nowhere" / "ca.pem")
    not_pem = tmp / "not.pem"
    not_pem.write_text("hello\n")
    cert, key = str(pki.client_cert), str(pki.client_key)
    return {
        "missing CA file": (
            {"url": TLS_URL, "ssl_ca_certs": missing},
            ["ssl_ca_certs", missing, "does not exist", "give the path of the PEM file"],
        ),
        "CA is a directory": (
            {"url": TLS_URL, "ssl_ca_certs": str(tmp)},
            ["ssl_ca_certs", "is not a file"],
        ),
        "CA file not PEM": (
            {"url": TLS_URL, "ssl_ca_certs": str(not_pem)},
            ["ssl_ca_certs", str(not_pem), "no usable CA certificate"],
        ),
        "missing key file": (
            {"url": TLS_URL, "ssl_certfile": cert, "ssl_keyfile": missing},
            ["ssl_keyfile", "does not exist"],
        ),
        "key of another certificate": (
            {"url": TLS_URL, "ssl_certfile": cert, "ssl_keyfile": str(pki.server_key)},
            ["ssl_certfile/ssl_keyfile", str(pki.server_key)],
        ),
        "key without certificate": (
            {"url": TLS_URL, "ssl_keyfile": key},
            ["ssl_keyfile is set without ssl_certfile"],
        ),
        "host name check without verification": (
            {"url": TLS_URL, "ssl_cert_reqs": "none", "ssl_check_hostname": True},
            ["ssl_check_hostname", "set ssl_check_hostname to false"],
        ),
        "unknown cert_reqs": (
            {"url": TLS_URL, "ssl_cert_reqs": "sometimes"},
            ["ssl_cert_reqs", "'required', 'optional' or 'none'"],
        ),
        "TLS settings on redis://": (
            {"url": "redis://h:6379/0", "ssl_ca_certs": str(pki.ca)},
            ["TLS options", "redis://", "use a rediss:// URL"],
        ),
        "verification off on redis://": (
            {"url": "redis://h:6379/0", "ssl_cert_reqs": "none"},
            ["TLS options", "use a rediss:// URL"],
        ),
        "TLS query on redis://": (
            {"url": "redis://h:6379/0?ssl_cert_reqs=none"},
            ["TLS options", "rediss://"],
        ),
        "TLS in the URL and in settings": (
            {"url": f"{TLS_URL}?ssl_cert_reqs=none", "ssl_ca_certs": str(pki.ca)},
            ["both in the URL (ssl_cert_reqs) and as settings"],
        ),
        "password in the URL and in settings": (
            {"url": "redis://:inurl@h/0", "password": "setpass"},
            ["password is given both in the URL and as the password setting"],
        ),
        "password in the query and in settings": (
            {"url": "redis://h/0?password=inurl", "password": "setpass"},
            ["both in the URL"],
        ),
        "empty password": ({"url": "redis://h/0", "password": ""}, ["password setting is empty"]),
        "not a Redis URL": (
            {"url": "http://:inurl@h/0"},
            ["not a redis://, rediss:// (TLS) or unix:// URL"],
        ),
    }


def test_bad_tls_settings_are_config_errors_that_say_what_to_do(pki: Pki, tmp_path: Path) -> None:
    for case, (settings, phrases) in bad_settings(pki, tmp_path).items():
        with pytest.raises(ConfigError) as err:
            config_of(**settings)
        message = str(err.value)
        assert message.startswith("invalid plait configuration: replication"), message
        assert "replication.redis" in message or "redis: " in message, message
        for phrase in phrases:
            assert phrase in message, (case, message)
        assert "inurl" not in message, case  # never a password
        assert "setpass" not in message, case
    # the transport checks what it is given the same way
    missing = str(tmp_path / "nowhere" / "ca.pem")
    with pytest.raises(ConfigError, match="does not exist"):
        redis_transport(RecordingHandler("a"), TLS_URL, "c", tls=RedisTls(missing))
    with pytest.raises(ConfigError, match="use a rediss:// URL"):
        redis_transport(RecordingHandler("a"), "redis://h/0", "c", tls=RedisTls())


def test_an_encrypted_client_key_is_refused_up_front_not_prompted_for(
    pki: Pki, tmp_path: Path
) -> None:
    """OpenSSL would ask for its pass phrase on the terminal when connecting."""
    serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")
    key = serialization.load_pem_private_key(pki.client_key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pass phrase"),
        )
    )
    with pytest.raises(ConfigError, match="unencrypted private key"):
        RedisTls(certfile=str(pki.client_cert), keyfile=str(encrypted))


def test_redis_settings_are_checked_only_where_redis_is_the_transport(tmp_path: Path) -> None:
    """A deployment on the TCP hub may keep a redis section naming files this machine
    does not have; with Redis as the transport, the same section is an error."""
    redis = {"url": TLS_URL, "ssl_ca_certs": str(tmp_path / "missing.pem")}
    base = {
        "instance_name": "a",
        "deployment": "d",
        "database": "postgresql://localhost/x",
        "streams": [{"name": "s", "tables": [{"name": "t"}], "writers": ["a"]}],
    }
    tcp = {"transport": "tcp", "redis": redis, "tcp": {"hub": "a"}}
    assert InstanceConfig.load({**base, "replication": tcp}).replication.transport == "tcp"
    with pytest.raises(ConfigError, match="ssl_ca_certs"):
        InstanceConfig.load({**base, "replication": {"transport": "redis", "redis": redis}})
