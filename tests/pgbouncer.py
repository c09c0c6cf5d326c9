"""A real PgBouncer (Debian's `pgbouncer` package) in front of the tests' PostgreSQL.

Each test gets its own login role whose `search_path` is a fresh schema: PgBouncer
refuses the startup packet's `options` that the other tests use for that (and would lose
a `connect_query`'s SET at its `DISCARD ALL`). The role is a superuser so that it may
create sequences and see every process in `pg_stat_activity`, as `postgres` does.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import pace
from plait.ports import free_port

# Where Debian puts it; not on a non-root user's PATH.
_PLACES = ("/usr/sbin/pgbouncer", "/usr/local/sbin/pgbouncer", "/usr/local/bin/pgbouncer")
_STARTS_WITHIN = 10.0


def pgbouncer_binary() -> str | None:
    found = shutil.which("pgbouncer")
    if found:
        return found
    return next((place for place in _PLACES if os.access(place, os.X_OK)), None)


class PgBouncer:
    """One PgBouncer process in `mode` (session, transaction or statement) on a free
    loopback port, forwarding database `test` to the server of `server_dsn`."""

    def __init__(
        self,
        binary: str,
        server_dsn: str,
        mode: str,
        user: str,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.mode = mode
        self.user = user
        self.port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix=f"plait-pgbouncer-{mode}-"))
        self._dir.chmod(0o755)  # read by the unprivileged user it switches to as root
        server = conninfo_to_dict(server_dsn)
        (self._dir / "users.txt").write_text(f'"{user}" ""\n')
        lines = [
            "[databases]",
            f"test = host={server.get('host') or '127.0.0.1'} port={server.get('port') or 5432}"
            f" dbname={server.get('dbname') or 'postgres'}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self._dir / 'users.txt'}",
            f"pool_mode = {mode}",
            "default_pool_size = 20",
            "max_client_conn = 200",
            *(f"{name} = {value}" for name, value in (settings or {}).items()),
        ]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            lines.append(f"user = {_unprivileged_user()}")
        config = self._dir / "pgbouncer.ini"
        config.write_text("\n".join(lines) + "\n")
        for path in self._dir.iterdir():
            path.chmod(0o644)
        self._log = self._dir / "pgbouncer.log"
        with self._log.open("wb") as log:
            self._process = subprocess.Popen(
                [binary, str(config)], stdout=log, stderr=subprocess.STDOUT
            )
        self._wait_listening()

    @property
    def dsn(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/test"

    def log(self) -> str:
        return self._log.read_text(errors="replace")

    def _wait_listening(self) -> None:
        limit = pace.scaled(_STARTS_WITHIN)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited at start:\n{self.log()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"waited {limit:.1f} s for pgbouncer to listen on port {self.port}:\n{self.log()}"
        )

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def _unprivileged_user() -> str:
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError("running as root, and neither user postgres nor nobody exists")


@contextmanager
def role_with_schema(server_dsn: str) -> Iterator[str]:
    """A new login role whose search_path is a new, empty schema; both dropped after."""
    name = f"plait_pgb_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        conn.execute(
            sql.SQL("ALTER ROLE {} SET search_path = {}").format(
                sql.Identifier(name), sql.Identifier(name)
            )
        )
    try:
        yield name
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))
            # Its server processes (PgBouncer's pool) are gone once PgBouncer stopped,
            # but a killed client's may still be ending.
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (name,),
            )
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@contextmanager
def pgbouncer(
    server_dsn: str, mode: str, user: str, settings: dict[str, str] | None = None
) -> Iterator[PgBouncer]:
    """PgBouncer in `mode`, with more pgbouncer.ini `settings`, stopped after."""
    binary = pgbouncer_binary()
    assert binary is not None, "check pgbouncer_binary() first"
    bouncer = PgBouncer(binary, server_dsn, mode, user, settings)
    try:
        yield bouncer
    finally:
        bouncer.stop()
