"""A partition the kernel makes, for `test_partition.py`: run as root, inside a network
namespace of its own (`unshare --net python partition_kernel.py ARGS_JSON`).

Nothing in between answers for anyone: PostgreSQL (its own, started here) and the
reader run in this namespace; writer w1 runs in a second one, joined to this by a veth
pair; writer w2 runs here. Taking w1's end of the pair down drops every packet between
them without a word, as a cut cable would: the server's keepalive probes and
retransmissions to w1 go unanswered. It prints one JSON line: seconds from the cut until
w1's server processes were all gone, and until the reader's linear position passed
everything w1 had taken, with how many connections w1 had when cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pace
from plait import Database
from plait.storage.embedded import EmbeddedPostgres
from stream_helpers import create_generator, create_table

ROLE = Path(__file__).with_name("fence_roles.py")
SERVER_ADDRESS, WRITER_ADDRESS = "10.77.0.1", "10.77.0.2"


def sh(*args: str) -> None:
    pace.run(args, 30, check=True, capture_output=True)


def network() -> tuple[subprocess.Popen[bytes], list[str]]:
    """The writer's namespace (kept by a sleeping process), wired to this one; and the
    command prefix that runs something in it."""
    sh("ip", "link", "set", "lo", "up")
    keeper = subprocess.Popen(["unshare", "--net", "sleep", "600"])
    ours = os.readlink("/proc/self/ns/net")
    limit = pace.scaled(10)
    deadline = time.monotonic() + limit
    while os.readlink(f"/proc/{keeper.pid}/ns/net") == ours:  # unshare has not run yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {limit:.1f} s for unshare to make a network namespace")
        time.sleep(0.01)
    inside = ["nsenter", f"--net=/proc/{keeper.pid}/ns/net"]
    sh("ip", "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", str(keeper.pid))
    sh("ip", "addr", "add", f"{SERVER_ADDRESS}/24", "dev", "va")
    sh("ip", "link", "set", "va", "up")
    sh(*inside, "ip", "link", "set", "lo", "up")
    sh(*inside, "ip", "addr", "add", f"{WRITER_ADDRESS}/24", "dev", "vb")
    sh(*inside, "ip", "link", "set", "vb", "up")
    return keeper, inside


def server(base: Path) -> EmbeddedPostgres:
    """An embedded server that also listens on the veth address and trusts the writer."""
    data_dir = base / "pgdata"
    EmbeddedPostgres.acquire(data_dir).release()  # initialised, then stopped
    with (data_dir / "postgresql.conf").open("a") as conf:
        conf.write(f"listen_addresses = '127.0.0.1,{SERVER_ADDRESS}'\n")
    with (data_dir / "pg_hba.conf").open("a") as hba:
        hba.write(f"host all all {WRITER_ADDRESS}/32 trust\n")
    return EmbeddedPostgres.acquire(data_dir)


async def spawn(prefix: list[str], dsn: str, name: str) -> asyncio.subprocess.Process:
    args = {"dsn": dsn, "name": name, "writers": ["w1", "w2"]}
    process = await asyncio.create_subprocess_exec(
        *prefix, sys.executable, str(ROLE), json.dumps(args), stdout=asyncio.subprocess.PIPE
    )
    assert process.stdout is not None
    line = await pace.wait(process.stdout.readline(), 30, f"writer {name} to say it started")
    if line != b"started\n":
        raise RuntimeError(f"writer {name} did not start: {line!r}")
    return process


async def backends_of(db: Database, instance: str) -> int:
    async with db.connection() as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"plait#% {instance}",),
        )
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def scenario(inside: list[str], pg: EmbeddedPostgres, args: dict[str, Any]) -> None:
    local = pg.dsn
    remote = local.replace("127.0.0.1", SERVER_ADDRESS)
    within = float(args["within"])
    db = await Database.connect(local)
    await db.migrate()
    await create_table(db)
    reader = await create_generator(
        db, ["w1", "w2"], "reader", position_flush_interval=0.1, fence_after=args["fence_after"]
    )
    writers = [await spawn(inside, remote, "w1"), await spawn([], local, "w2")]
    try:
        await asyncio.sleep(1.0)  # both write, four transactions at a time each
        connections = await backends_of(db, "w1")
        sh(*inside, "ip", "link", "set", "vb", "down")
        cut = time.monotonic()
        head = await reader.get_max_allocated_token()  # w1 took nothing past it since
        gone = passed = None
        while time.monotonic() - cut < within and passed is None:
            if gone is None and await backends_of(db, "w1") == 0:
                gone = time.monotonic() - cut
            if gone is not None and reader.get_current_token() >= head:
                passed = time.monotonic() - cut
            await asyncio.sleep(0.05)
        print(json.dumps({"connections": connections, "gone": gone, "passed": passed}))
    finally:
        for process in writers:
            # w1 may have exited already: a statement it sent after the cut can fail at
            # once ("Network is unreachable"), and its role does not catch that.
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        await reader.close()
        await db.close()


def in_namespaces(
    prefix: str, run: Callable[[list[str], EmbeddedPostgres], Coroutine[Any, Any, None]]
) -> None:
    """`run(inside, pg)` with the second namespace wired up and a server of its own,
    all removed again afterwards."""
    keeper, inside = network()
    base = Path(tempfile.mkdtemp(prefix=prefix))
    base.chmod(0o755)  # the server's user (when run as root) must reach its data dir
    pg = server(base)
    try:
        asyncio.run(run(inside, pg))
    finally:
        pg.release()
        keeper.kill()
        subprocess.run(["rm", "-rf", str(base)], check=False)


def main(args: dict[str, Any]) -> None:
    in_namespaces("plait-partition-", lambda inside, pg: scenario(inside, pg, args))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
