"""The checker's orchestrator: start everything, break it on schedule, drain, judge.

One run, in order:
1. a fresh schema in the database; the streams' tables; Redis of our own or the hub
   behind a proxy that can cut its connections; a fault proxy in front of PostgreSQL
   for each writer (`_proxy_databases`);
2. the readers, then the writers, each a process of its own;
3. the fault schedule, while the writers write;
4. the drain: every fault undone, dead writers restarted, writers told to go idle; the
   readers get targets (the highest committed IDs, from the database) and must reach
   them;
5. the journals are read back and judged (`judging`, `verdict`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
from redis.asyncio import Redis

from plait.check import journal, schema
from plait.check.error_lines import last_error
from plait.check.faults import FaultLog, Partition, schedule
from plait.check.journal import Kind
from plait.check.judging import Run, judge
from plait.check.options import Options
from plait.check.plan import (
    PG_OUTAGES,
    PG_PARTITION,
    SPARK,
    Plan,
    fault_near,
    keepalive_bound,
    postgres_fault_near,
    write_control,
)
from plait.check.postgres import RestartablePostgres
from plait.check.process import CheckedProcess
from plait.check.proxy import CutProxy
from plait.check.redis_server import RedisServer
from plait.check.report import Report
from plait.check.roles import FENCED_EXIT, UNAVAILABLE_EXIT
from plait.config import InstanceConfig
from plait.errors import PlaitError
from plait.ports import free_port

START_TIMEOUT = 60.0
# A Spark reader starts a JVM and plans a first query per stream: on a machine the
# other processes keep busy that can take longer than any other process's start.
SPARK_START_TIMEOUT = 180.0
WRITER_FAULTS = ("kill", "stop", "slow_commit", "pg_terminate")  # the rest hit a transport
CATCH_UP_TIMEOUT = 60.0
# A partition lasts the keepalive bound (then its connections are dropped), `fence_after`
# (for the others to fence the writer), and this long again, at random: the writer comes
# back after the fence, a fenced live writer.
PARTITION_AFTER_FENCE = (2.0, 4.0)


class Checker:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.seed = options.seed if options.seed is not None else random.randrange(2**31)
        self.rng = random.Random(self.seed)
        self.faults = FaultLog()
        self._tasks: set[asyncio.Task[Any]] = set()  # the writers' supervisors
        self._pauses: set[asyncio.Task[None]] = set()  # SIGSTOPs waiting for their SIGCONT
        self._stopping = False
        self._redis: RedisServer | None = None
        self._pg: RestartablePostgres | None = None  # a server of the checker's own
        self._server_dsn = options.dsn or ""
        self._proxy: CutProxy | None = None
        self._db_proxies: dict[str, CutProxy] = {}  # per writer, in front of PostgreSQL
        self._partitions: set[asyncio.Task[None]] = set()  # partitions waiting to heal
        self._keepalive_bound = 0.0
        self._schema = f"plait_check_{uuid.uuid4().hex[:10]}"
        self._control: dict[str, Any] = {}  # the orders in the control file
        self._faults_began = 0.0  # time.time() when the schedule started
        self.run_dir: Path | None = None  # where journals and logs go, once made

    async def run(self, progress: Any = None) -> Report:
        say = progress or (lambda text: None)
        if self.options.dsn is not None:
            return await self._run(say)
        say("starting a PostgreSQL server of the checker's own (it may restart it)")
        self._pg = await asyncio.to_thread(RestartablePostgres.fresh)
        self._server_dsn = self._pg.dsn
        try:
            return await self._run(say)
        finally:
            await asyncio.to_thread(self._pg.close)

    async def _run(self, say: Any) -> Report:
        options = self.options
        run_dir = options.run_dir or Path(tempfile.mkdtemp(prefix="plait-check-"))
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        started = time.monotonic()
        plan = await self._prepare(run_dir)
        self.plan = plan
        self.faults.journal = journal.Journal(run_dir / "faults.journal")
        self._write_control(phase="run")
        writers = [CheckedProcess("writer", w, plan) for w in plan.writers]
        readers = [CheckedProcess(r, r, plan) for r in options.readers]
        self.writers, self.readers = writers, readers
        problems: list[str] = []
        try:
            say(f"schema {self._schema}, {options.transport}, seed {self.seed}, in {run_dir}")
            for reader in readers:  # the follower first: it is the TCP hub
                await reader.spawn()
                within = SPARK_START_TIMEOUT if reader.name == SPARK else START_TIMEOUT
                if not await reader.until("started", within):
                    raise RuntimeError(await reader.why_not("started", within))
            for w in writers:
                self._spawn_task(self._supervise(w))
            for w in writers:
                if not await w.until("started", START_TIMEOUT):
                    raise RuntimeError(await w.why_not("started", START_TIMEOUT))
            say(f"running {options.duration:g} s of writes and faults")
            await self._inject(time.time())
            say("draining: faults undone, writers going idle")
            problems += await self._drain()
            truth, kv_truth, targets = await schema.truth(self.plan)
            self._write_control(targets=targets)
            deadline = time.monotonic() + CATCH_UP_TIMEOUT  # for all of them at once
            for reader in readers:
                if not await reader.until("caught-up", deadline - time.monotonic()):
                    problems.append(f"{reader.name} did not catch up in {CATCH_UP_TIMEOUT:g} s")
            if problems:
                self._dump_tasks()
            died = self._reader_deaths()
        finally:
            await self._stop_all()
        say("judging")
        if "slow_commit" in self.options.fault_counts:
            self.faults.counts["slow_commit"] = self._slow_commits_made()  # begun, not asked
        run = Run(self.options, self.seed, self.faults, self._faults_began, self._keepalive_bound)
        report = judge(run, plan, truth, kv_truth, time.monotonic() - started, died)
        report.findings[:0] = problems
        if report.ok and not options.keep:
            await schema.drop_schema(self._server_dsn, self._schema)
            if options.run_dir is None:  # a temporary folder of ours, not the user's
                shutil.rmtree(run_dir, ignore_errors=True)
                report.run_dir_kept = False
        return report

    # -- setting up ---------------------------------------------------------------------------

    async def _prepare(self, run_dir: Path) -> Plan:
        options = self.options
        dsn, server = await schema.create_schema(self._server_dsn, self._schema)
        plan = Plan(
            dsn=dsn,
            transport=options.transport,
            run_dir=run_dir,
            writers=tuple(f"w{i}" for i in range(options.writers)),
            streams=options.streams,
            fence_after=options.fence_after,
            batch=options.batch,
        )
        await schema.create_tables(plan)
        plan = await self._proxy_databases(plan, *server)
        if options.transport == "redis":
            self._redis = RedisServer()
            await asyncio.to_thread(self._redis.start)
            return replace(plan, redis_url=self._redis.url)
        hub_port, proxy_port = free_port(), free_port()
        self._proxy = CutProxy(proxy_port, hub_port)
        await self._proxy.start()
        return replace(plan, hub_port=hub_port, proxy_port=proxy_port)

    async def _proxy_databases(self, plan: Plan, host: str, port: int) -> Plan:
        """A fault proxy in front of PostgreSQL for each writer (`pg_partition` black-holes
        one); the readers connect directly. Always, on the checker's own server or one
        named with a DSN alike: a partition touches only one writer's connections, never
        the server, and the writers reach the database the same way whatever the run's
        faults. The writers' `database_timeouts` say how long a partition holds its
        connections before it drops them (`keepalive_bound`)."""
        unix = f"{host}/.s.PGSQL.{port}" if host.startswith("/") else None
        for w in plan.writers:
            proxy = CutProxy(0, port, target_host=host, target_unix=unix)
            await proxy.start()
            self._db_proxies[w] = proxy
        plan = replace(plan, db_ports={w: p.port for w, p in self._db_proxies.items()})
        timeouts = InstanceConfig.load(plan.instance_config(plan.writers[0])).database_timeouts
        if PG_PARTITION in self.options.fault_counts:
            self._keepalive_bound = keepalive_bound(timeouts)
        return plan

    def _write_control(self, **changes: Any) -> None:
        self._control.update(changes)
        write_control(self.plan.control, self._control)

    def _order(self, what: str, target: str) -> None:
        """One more `what` for process `target` to do: a count in the control file,
        where a signal would merge with one sent just before."""
        orders = self._control.setdefault(what, {})
        orders[target] = orders.get(target, 0) + 1
        self._write_control()

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _supervise(self, w: CheckedProcess) -> None:
        """Keep writer `w` running: restart it after a kill, a fence or a crash."""
        while not self._stopping:  # also after each wait below: nothing new once stopping
            await w.spawn()
            assert w.proc is not None
            code = await w.proc.wait()
            if self._stopping:
                return
            now = time.time()
            self.faults.note(f"exit-{code}", w.name)
            if w.killed:
                await asyncio.sleep(w.restart_delay)
                w.killed = False
            elif code == UNAVAILABLE_EXIT and (
                self._pg_recently_down(now)
                or fault_near(self.faults.partitioned_windows(w.name), now)
            ):
                self.faults.death(w.name, now)
                self.faults.note("unavailable", w.name)
                await asyncio.sleep(0.5)
            elif code == FENCED_EXIT:
                self.faults.fenced_alive += 1
                self.faults.death(w.name, now)
                await asyncio.sleep(0.2)
            else:
                self.faults.death(w.name, now)
                self.faults.crashes.append(f"{w.name} exited with {code}:\n{w.log_tail()}")
                await asyncio.sleep(0.2)
            self.faults.restarts += 1

    # -- faults -------------------------------------------------------------------------------

    async def _inject(self, t0: float) -> None:
        self._faults_began = t0
        options = self.options
        counts = options.fault_counts
        lasting = {PG_PARTITION: self._partition_length(PARTITION_AFTER_FENCE[1])}
        plan = schedule(counts, options.duration, self.rng, lasting)
        for at, kind in plan:
            await asyncio.sleep(max(0.0, t0 + at - time.time()))
            deadline = time.time() + 5.0
            while not await self._fault(kind) and time.time() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.1)  # until a writer is there to take it
        await asyncio.sleep(max(0.0, t0 + options.duration - time.time()))
        # A fault that found no target in time (every writer dead or paused on a loaded
        # machine) is made up now, so each kind reaches its count.
        deadline = time.time() + 30.0
        for kind, n in counts.items():
            while self._done(kind) < n and time.time() < deadline:
                if not await self._fault(kind):
                    await asyncio.sleep(0.1)
                elif kind == "slow_commit":
                    await asyncio.sleep(0.3)  # for the writer to take it

    def _done(self, kind: str) -> int:
        """Faults of `kind` so far; slow commits count once a writer began one (one
        asked of a writer killed before its next transaction is never made)."""
        if kind == "slow_commit":
            return self._slow_commits_made()
        return self.faults.counts[kind]

    def _slow_commits_made(self) -> int:
        return sum(1 for _ in journal.read(self.plan.slow_made))

    async def _fault(self, kind: str) -> bool:
        """Inject one fault of `kind`; False when nothing could take it just now, or it
        could not be injected (counted, `FaultLog.could_not_inject`): the schedule tries
        again later. Never raises for what the faults themselves broke: a PostgreSQL
        down or refusing connections (`too many clients`) is the run's weather."""
        try:
            return await self._try_fault(kind)
        except (psycopg.Error, OSError, PlaitError) as err:
            self.faults.could_not_inject(kind, err)
            return False

    async def _try_fault(self, kind: str) -> bool:
        rng = self.rng
        target: CheckedProcess | None = None
        if kind in WRITER_FAULTS or kind == PG_PARTITION:
            # One partition of a writer at a time (other faults may hit it meanwhile).
            live = [w for w in self.writers if w.live and not self._partitioned(kind, w)]
            if not live:
                return False
            target = rng.choice(live)
        name = target.name if target is not None else "-"
        if kind == "kill" and target is not None:
            assert target.proc is not None
            target.killed = True
            target.restart_delay = rng.uniform(0.2, 1.0)
            self.faults.death(target.name, time.time())
            target.proc.kill()
        elif kind == "stop" and target is not None:
            pause = asyncio.create_task(self._pause(target, rng.uniform(0.3, 2.0)))
            self._pauses.add(pause)
            pause.add_done_callback(self._pauses.discard)
        elif kind == "slow_commit" and target is not None:
            self._order("slow", target.name)
            self.faults.note(kind, name)
            return True  # counted when made (`_done`)
        elif kind == "pg_terminate" and target is not None:
            if not await schema.terminate_backend(self.plan.dsn, target.name, self.rng):
                return False
        elif kind == "transport_cut":
            if not await self._cut():
                return False
        elif kind == "redis_restart":
            assert self._redis is not None
            down = time.time()
            await asyncio.to_thread(self._redis.stop, kill=True)
            await asyncio.sleep(rng.uniform(0.1, 0.5))
            await asyncio.to_thread(self._redis.start)
            self.faults.outage(down, time.time())
        elif kind in PG_OUTAGES:
            await self._pg_outage(kind)
        elif kind == PG_PARTITION and target is not None:
            length = self._partition_length(rng.uniform(*PARTITION_AFTER_FENCE))
            partition = self.faults.partitioned(target.name, time.time())
            self._db_proxies[target.name].black_hole()
            task = asyncio.create_task(self._partition(target.name, partition, length))
            self._partitions.add(task)
            task.add_done_callback(self._partitions.discard)
        elif kind == "spark_restart":
            spark = next(r for r in self.readers if r.name == SPARK)
            if not spark.live:
                return False
            self._order("restart", spark.name)
        self.faults.injected(kind, name)
        return True

    def _partitioned(self, kind: str, w: CheckedProcess) -> bool:
        return kind == PG_PARTITION and self.faults.partitioned_now(w.name)

    def _partition_length(self, after_fence: float) -> float:
        """How long a partition lasts: the keepalive bound, `fence_after`, then
        `after_fence` seconds more."""
        return self._keepalive_bound + self.options.fence_after + after_fence

    async def _partition(self, writer: str, partition: Partition, length: float) -> None:
        """Writer `writer`'s database proxy is a black hole now (`_try_fault`): after the
        keepalive bound, drop the connections it holds, as both ends' keepalives would
        (the server's processes of that run end: the others may fence it, while it
        lives on, cut off); heal `length` seconds after it began. The writer must then
        go on by itself: a new incarnation (`renewed` in its journal), or an exit with
        FENCED_EXIT that its supervisor restarts."""
        proxy = self._db_proxies[writer]
        try:
            await asyncio.sleep(max(0.0, partition.hole + self._keepalive_bound - time.time()))
            partition.cut = time.time()
            self.faults.note("cut", f"{writer} {proxy.drop_all()}")
            await asyncio.sleep(max(0.0, partition.hole + length - time.time()))
        finally:
            proxy.heal()
            partition.healed = time.time()
            self.faults.note("healed", writer)

    def _pg_recently_down(self, now: float) -> bool:
        return postgres_fault_near(self._control, now)

    async def _pg_outage(self, kind: str) -> None:
        """Restart (fast shutdown) or crash (kill -9 of the postmaster) the checker's
        own PostgreSQL, then start it again on the same port: every process loses every
        connection, and must reconnect and go on by itself."""
        pg = self._pg
        assert pg is not None, "PostgreSQL faults need a server the checker started"
        down = time.time()
        # In the orders first, so a Spark query that fails now knows why (`spark_reader`).
        windows = self._control.setdefault("pg_down", [])
        windows.append([down, None])
        self._write_control()
        try:
            if kind == "pg_restart":
                await asyncio.to_thread(pg.restart)
            else:
                await asyncio.to_thread(pg.crash)
        finally:  # down until it accepts connections again, even when that failed
            up = time.time()
            self.faults.db_outage(down, up)
            windows[-1][1] = up
            self._write_control()

    async def _pause(self, w: CheckedProcess, seconds: float) -> None:
        assert w.proc is not None
        proc = w.proc
        w.stopped = True
        start = time.time()
        proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
            self.faults.stop(w.name, start, time.time())
            w.stopped = False

    async def _cut(self) -> bool:
        if self._proxy is not None:
            return self._proxy.cut(self.rng)
        assert self._redis is not None
        client = Redis.from_url(self._redis.url)
        try:
            me = await client.client_id()
            others = [c["id"] for c in await client.client_list() if int(c["id"]) != me]
            if not others:
                return False
            await client.client_kill_filter(_id=self.rng.choice(others))
            return True
        except OSError:
            return False
        finally:
            await client.aclose()

    # -- draining and stopping ----------------------------------------------------------------

    async def _drain(self) -> list[str]:
        problems = []
        await asyncio.gather(*self._pauses, *self._partitions, return_exceptions=True)
        if self._redis is not None:
            await asyncio.to_thread(self._redis.start)
        if self._pg is not None:  # a restart that failed half-way
            try:
                await asyncio.to_thread(self._pg.ensure_running)
            except PlaitError as err:
                problems.append(f"the checker's PostgreSQL did not come back: {err}")
        for w in self.writers:
            if not await w.until("started", START_TIMEOUT):
                problems.append(f"{w.name} did not restart:\n{w.log_tail()}")
        self._write_control(phase="idle")
        for w in self.writers:
            if not await w.until("idle", self.plan.slow_commit + START_TIMEOUT):
                problems.append(f"{w.name} did not go idle:\n{w.log_tail()}")
        return problems

    async def _stop_all(self) -> None:
        self._stopping = True
        with contextlib.suppress(Exception):
            self._write_control(phase="stop")
        procs = [p for p in self.writers + self.readers if p.proc is not None]
        for p in procs:
            assert p.proc is not None
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGCONT)
            try:
                async with asyncio.timeout(30):
                    await p.proc.wait()
            except TimeoutError:
                p.proc.kill()
                await p.proc.wait()
        for task in [*self._tasks, *self._pauses, *self._partitions]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._pauses, *self._partitions, return_exceptions=True)
        for p in self.writers + self.readers:
            await p.listeners.aclose()
        if self._proxy is not None:
            await self._proxy.stop()
        for proxy in self._db_proxies.values():
            await proxy.stop()
        if self._redis is not None:
            await asyncio.to_thread(self._redis.close)
        if self.faults.journal is not None:
            self.faults.journal.close()

    def _reader_deaths(self) -> dict[str, str]:
        """Why a reader stopped reading before the end, in its own words: the last
        error line of its standard error when its process exited, or a Spark query's
        failure from its journal. The verdict shows it next to the rows it then lost."""
        died: dict[str, str] = {}
        for reader in self.readers:
            for line in journal.read(self.plan.journal(reader.name)):
                if line.kind == Kind.STATE and line.fields[0] == "query-failed":
                    died[reader.name] = "a query failed: " + " ".join(line.fields[1:])
            proc = reader.proc
            if proc is not None and proc.returncode is not None and not reader.killed:
                cause = last_error(reader.log_text()) or "(nothing on its standard error)"
                died[reader.name] = f"exited with {proc.returncode}: {cause}"
        return died

    def _dump_tasks(self) -> None:
        """Ask every process to log what each of its tasks awaits (`roles.dump_tasks`):
        for whoever reads why something never caught up or went idle."""
        for p in self.writers + self.readers:
            if p.proc is not None and p.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.send_signal(signal.SIGUSR1)
