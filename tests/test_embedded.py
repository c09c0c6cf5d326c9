"""The zero-setup server: Database.connect(None) starts, shares and stops it."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from plait import Database
from plait.storage.embedded import EmbeddedPostgres


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
                cur = await conn.execute("SELECT count(*) FROM plait_schema_version")
                assert await cur.fetchone() == (1,)
        finally:
            assert again.release()
    finally:
        for db in (first, second):
            await db.close()
