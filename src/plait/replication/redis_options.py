"""Redis connection settings, checked before anything connects: the transport's options
(`RedisOptions`, which the configuration's `replication.redis` extends), TLS
(`RedisTls`) and the password, fitted to the URL (`client_options`), and whether the URL
may carry unsigned lines (`check_signing`). Apart from the transport, so the configuration checks
them without depending on the transport or on redis-py.

An ACL user per deployment needs nothing of its own here: give its name in the URL
(`redis://plait-prod@host:6379/0`, or `redis://plait-prod:<password>@...`) and its
password there or in the password setting; redis-py sends `AUTH <user> <password>`.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import Field, SecretStr

from plait.core.redact import redact
from plait.errors import ConfigError
from plait.options import Options, revealed

CertReqs = Literal["required", "optional", "none"]
_CERT_REQS = ("required", "optional", "none")


@dataclass(frozen=True, slots=True)
class RedisTls:
    """TLS settings of a rediss:// connection, named after redis-py's `ssl_*` options;
    files are PEM. The defaults verify the server's certificate against the system's CAs
    and its host name against the URL's. Checked when made: `ConfigError` names the
    setting, the file and what to do, so nothing fails later at connect time."""

    ca_certs: str | None = None  # the CA(s) that signed the server's certificate
    certfile: str | None = None  # a client certificate, for a server that asks for one
    keyfile: str | None = None  # its private key, unless certfile holds it too
    cert_reqs: CertReqs = "required"  # verify the server's certificate
    check_hostname: bool | None = None  # None: verify the host name unless cert_reqs is none

    def __post_init__(self) -> None:
        if self.cert_reqs not in _CERT_REQS:
            raise ConfigError(
                f"redis: ssl_cert_reqs {self.cert_reqs!r} is not one of {', '.join(_CERT_REQS)}"
            )
        if self.check_hostname and self.cert_reqs == "none":
            raise ConfigError(
                "redis: ssl_check_hostname needs the server's certificate checked, but "
                "ssl_cert_reqs is 'none'; set ssl_check_hostname to false, or verify the "
                "server (ssl_cert_reqs 'required', with ssl_ca_certs naming its CA)"
            )
        if self.keyfile is not None and self.certfile is None:
            raise ConfigError(
                "redis: ssl_keyfile is set without ssl_certfile; give the client "
                "certificate in ssl_certfile too (or drop ssl_keyfile)"
            )
        self._check_files()

    def _check_files(self) -> None:
        """Load every file into a throw-away context: a missing, unreadable or wrong file
        is reported now, naming it, rather than as a reconnect loop later. The context
        loads no CA store of its own (the system's takes milliseconds)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if self.ca_certs is not None:
            _check_file("ssl_ca_certs", self.ca_certs, "the CA of the server's certificate")
            try:
                context.load_verify_locations(cafile=self.ca_certs)
            except (ssl.SSLError, OSError) as err:
                raise ConfigError(
                    f"redis: ssl_ca_certs {self.ca_certs!r} holds no usable CA certificate "
                    f"({err}); give the PEM file of the CA that signed the server's certificate"
                ) from None
        if self.certfile is not None:
            _check_file("ssl_certfile", self.certfile, "the client certificate")
            if self.keyfile is not None:
                _check_file("ssl_keyfile", self.keyfile, "the client certificate's private key")
            try:
                # A callable password: an encrypted key fails here instead of OpenSSL
                # prompting for a pass phrase on the terminal (redis-py would, at connect).
                context.load_cert_chain(self.certfile, self.keyfile, password=_no_pass_phrase)
            except (ssl.SSLError, OSError) as err:
                files = repr(self.certfile) + (f" and {self.keyfile!r}" if self.keyfile else "")
                raise ConfigError(
                    f"redis: ssl_certfile/ssl_keyfile: {files} are not a PEM certificate "
                    f"with its unencrypted private key ({err}); give the client certificate "
                    "in ssl_certfile and its key (unencrypted) in ssl_keyfile or in the same file"
                ) from None

    def client_kwargs(self) -> dict[str, Any]:
        """The settings as redis-py's keyword arguments."""
        check_hostname = self.check_hostname
        if check_hostname is None:
            check_hostname = self.cert_reqs != "none"
        return {
            "ssl_ca_certs": self.ca_certs,
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_cert_reqs": self.cert_reqs,
            "ssl_check_hostname": check_hostname,
        }


def _check_file(option: str, path: str, what: str) -> None:
    if not os.path.isfile(path):
        problem = "is not a file" if os.path.exists(path) else "does not exist"
        raise ConfigError(
            f"redis: {option} {path!r} {problem}; give the path of the PEM file of {what} "
            "(relative paths are from the working directory)"
        )
    if not os.access(path, os.R_OK):
        raise ConfigError(
            f"redis: {option} {path!r} cannot be read by this process; make it readable "
            "by the user plait runs as"
        )


def _no_pass_phrase() -> str:
    return ""


def client_options(
    url: str, *, tls: RedisTls | None = None, password: str | None = None
) -> dict[str, Any]:
    """The keyword arguments that give `Redis.from_url(url, ...)` the TLS settings and
    the password, once checked against the URL: `ConfigError` when they do not fit it.
    A rediss:// URL without `tls` gets `RedisTls()` (verify everything), unless its
    query holds ssl_* options of its own, which redis-py then applies."""
    try:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        in_url = parts.password is not None or "password" in query
    except ValueError as err:
        raise ConfigError(f"redis: the URL {redact(url)!r} is malformed: {err}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(
            f"redis: {redact(url)!r} is not a redis://, rediss:// (TLS) or unix:// URL"
        )
    options: dict[str, Any] = {}
    if password is not None:
        if in_url:
            raise ConfigError(
                "redis: a password is given both in the URL and as the password setting; "
                "keep one (the setting keeps it out of the URL)"
            )
        if not password:
            raise ConfigError("redis: the password setting is empty; give one or remove it")
        options["password"] = password
    url_tls = sorted(name for name in query if name.startswith("ssl_"))
    if parts.scheme != "rediss":
        if tls is not None or url_tls:
            raise ConfigError(
                f"redis: TLS options are set but the URL is {parts.scheme}://, which has no "
                "TLS; use a rediss:// URL for a server that speaks TLS, or remove the "
                "ssl_* options"
            )
    elif url_tls and tls is not None:
        raise ConfigError(
            f"redis: TLS options are given both in the URL ({', '.join(url_tls)}) and as "
            "settings; keep one place (redis-py would let the URL win)"
        )
    elif not url_tls:
        options.update((tls if tls is not None else RedisTls()).client_kwargs())
    return options


def is_local(url: str) -> bool:
    """Whether `url` names a Redis on this machine: a unix:// socket, localhost or a
    loopback address. Any other name may resolve anywhere."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return False
    if parts.scheme == "unix":
        return True
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_signing(url: str, secret: str | None) -> None:
    """`ConfigError` when lines would travel unsigned through a Redis off this machine,
    or the secret is empty. Whoever may PUBLISH on the channel could otherwise inject
    rows and positions, as anyone who reaches an internal HTTP API without a secret
    could call it (which is refused alike)."""
    if secret is not None:
        if not secret:
            raise ConfigError(
                "replication.secret is empty; give a long random string, the same on "
                "every instance (or remove it)"
            )
        return
    if not is_local(url):
        raise ConfigError(
            f"redis: {redact(url)!r} is not on this machine and replication.secret is not "
            "set, so any client of that Redis allowed to PUBLISH could inject rows and "
            "positions: set replication.secret (a long random string, the same on every "
            "instance), which signs every line; give plait an ACL user of its own too"
        )


_TLS_SETTINGS = (
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
)


class RedisOptions(Options):
    """Where the Redis of the deployment is, and when the transport gives up on it: the
    defaults and bounds in one place. `rediss://` URLs speak TLS; the `ssl_*` settings
    (redis-py's names) apply to them only. The password may sit in the URL or, to keep
    it out of a URL, in `password`; it is never logged."""

    url: str = "redis://127.0.0.1:6379/0"
    """`redis://`, `rediss://` (TLS) or `unix://`."""
    password: SecretStr | None = None
    """The password, kept out of the URL; never logged."""
    ping_interval: float = Field(30.0, gt=0)
    """Seconds between pings that find a dead connection."""
    connect_timeout: float = Field(5.0, gt=0)
    """Seconds for connecting, AUTH and SUBSCRIBE."""
    max_clock_skew: float = Field(60.0, gt=0)
    """With `replication.secret`: how far (seconds) the first message of each sender's
    connection may be stamped from this machine's clock (a replay of an older one is
    refused). Clocks must agree within this (NTP)."""
    ssl_ca_certs: str | None = None
    """PEM file of the CA(s) that signed the server's certificate; unset: the system's."""
    ssl_certfile: str | None = None
    """A client certificate (PEM), for a server that asks for one (tls-auth-clients)."""
    ssl_keyfile: str | None = None
    """The client certificate's unencrypted private key, unless the certificate file
    holds it too."""
    ssl_cert_reqs: CertReqs | None = None
    """Verify the server's certificate: `required` (unset) or `none`."""
    ssl_check_hostname: bool | None = None
    """Verify the server's host name against its certificate; unset: unless
    `ssl_cert_reqs` is `none`."""

    def check(self) -> None:
        """ConfigError (a ValueError, so reported like any other bad value): a missing
        certificate file, TLS settings on a redis:// URL, a password given twice."""
        self.client_options()

    def client_options(self) -> dict[str, Any]:
        """redis-py's keyword arguments for the TLS settings and the password, checked
        against the URL (`client_options`)."""
        return client_options(self.url, tls=self.tls(), password=self.password_value())

    def tls(self) -> RedisTls | None:
        """The TLS settings, or None when none of them is set (rediss:// URLs then verify
        the server against the system's CAs)."""
        if all(getattr(self, name) is None for name in _TLS_SETTINGS):
            return None
        return RedisTls(
            ca_certs=self.ssl_ca_certs,
            certfile=self.ssl_certfile,
            keyfile=self.ssl_keyfile,
            cert_reqs=self.ssl_cert_reqs or "required",
            check_hostname=self.ssl_check_hostname,
        )

    def password_value(self) -> str | None:
        return revealed(self.password)
