"""One process of a checker run (a writer or a reader, `plait.check.roles`): started,
its standard output followed for the words it says ("started", "idle", "caught-up"),
its log kept for a failed run's report."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time

from plait.check import journal
from plait.check.plan import (
    Plan,
)
from plait.tasks import TaskSet


class CheckedProcess:
    """One checker process, and what its standard output said."""

    def __init__(self, role: str, name: str, plan: Plan) -> None:
        self.role, self.name, self._plan = role, name, plan
        # A writer is restarted whenever it exits (`Checker._supervise`): waiting for
        # what it says goes on across its exits.
        self.supervised = role == "writer"
        self.proc: asyncio.subprocess.Process | None = None
        self.said: set[str] = set()
        self.heard = asyncio.Event()
        self.killed = False
        self.stopped = False
        self.restart_delay = 0.0
        self._log = plan.run_dir / f"{name}.log"
        # Reading each run's standard output until it closes; the checker's stop cancels
        # and waits for them (a child may keep a pipe open).
        self.listeners = TaskSet(f"check process {name}")

    async def spawn(self) -> None:
        self.said.clear()
        with self._log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "plait.check.roles",
                self.role,
                self.name,
                self._plan.to_json(),
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
            )
        self.listeners.start(self._listen(self.proc), name=f"plait-check-listen-{self.name}")

    async def _listen(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            if proc is self.proc:
                self.said.add(line.decode().strip())
                self.heard.set()
                self.heard = asyncio.Event()
        if proc is self.proc and self.supervised:
            self.said.clear()  # what a dead run said is not what its restart will say

    async def until(self, word: str, timeout: float) -> bool:  # noqa: ASYNC109
        deadline = time.monotonic() + timeout
        while word not in self.said:
            exited = self.proc is not None and self.proc.returncode is not None
            if exited and not self.killed and not self.supervised:
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.5)):
                    await self.heard.wait()
        return True

    @property
    def live(self) -> bool:
        """Running, started and not paused: a fault may target it."""
        return (
            self.proc is not None
            and self.proc.returncode is None
            and "started" in self.said
            and not self.killed
            and not self.stopped
        )

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def log_text(self) -> str:
        try:
            return self._log.read_text(errors="replace")
        except OSError:
            return ""

    async def why_not(self, word: str, timeout: float) -> str:  # noqa: ASYNC109
        """Why it did not say `word`: exited (with what) or still running, and the tail
        of its standard error and of its journal. A process still running is asked to
        log where its tasks wait first (`roles.dump_tasks`)."""
        proc = self.proc
        if proc is None:
            state = "never started"
        elif proc.returncode is not None:
            state = f"exited with {proc.returncode}"
        else:
            state = f"still running {timeout:g} s later"
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGUSR1)
            await asyncio.sleep(1.0)  # for the dump to reach the log
        tail = self.log_tail(40) or "(nothing on its standard error)"
        lines = list(journal.read(self._plan.journal(self.name)))[-5:]
        said = "\n".join(f"{line.kind} {line.t:.3f} {' '.join(line.fields)}" for line in lines)
        return (
            f"{self.name} did not say {word!r}: {state}.\n"
            f"its standard error ({self._log}) ends:\n{tail}\n"
            f"its journal ends:\n{said or '(empty)'}"
        )
