"""How slow this machine runs the tests right now, for bounds that are about speed.

A bound about speed (how long a stall may last, how soon something starts) holds on a
quiet machine; on a busy one (other work running, a laptop on battery) the same code
takes longer without being wrong. `slowness()` says how much longer: the environment's
PLAIT_TEST_SLOWNESS when set, else the load average per core the tests may use (1 on a
quiet machine, 4.5 at load 9 on 2 cores), read anew at each call so that it follows the
load through a long run. `scaled(seconds)` is a bound for this machine now; `within`,
`wait` and `until` wait at that pace, and `run` and `communicate` for a subprocess: a
wait that times out says what it waited for and for how long.

The same guarantees on their strict, quiet-machine bounds live in tests marked `timing`
(`pytest -m timing`, which CI runs on its quiet machine); the default run leaves them out.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import psutil

T = TypeVar("T")

MAX_SLOWNESS = 10.0  # past this the machine is not busy but stuck: let the test say so


def slowness() -> float:
    given = os.environ.get("PLAIT_TEST_SLOWNESS")
    if given:
        return min(MAX_SLOWNESS, max(1.0, float(given)))
    # The load average counts the whole machine's run queue, so it is shared out over
    # the whole machine's cores (a container pinned to fewer would see it inflated).
    return min(MAX_SLOWNESS, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def scaled(seconds: float) -> float:
    """`seconds`, a bound measured on a quiet machine, for this machine's pace now."""
    return seconds * slowness()


@contextlib.asynccontextmanager
async def within(seconds: float, what: str) -> AsyncIterator[None]:
    """`asyncio.timeout` for `seconds` at this machine's pace (`scaled`), whose
    TimeoutError says what was waited for and for how long."""
    async with bounded(scaled(seconds), what):
        yield


@contextlib.asynccontextmanager
async def bounded(limit: float, what: str) -> AsyncIterator[None]:
    """`within` for a `limit` taken as it is: one already at this machine's pace (a
    caller's, or a process's that was given it), or a quiet machine's on purpose."""
    timeout = asyncio.timeout(limit)
    try:
        async with timeout:
            yield
    except TimeoutError:
        if not timeout.expired():
            raise  # a timeout of the body's own, which says what it waited for
        raise TimeoutError(f"waited {limit:.1f} s for {what}") from None


async def wait(awaitable: Awaitable[T], seconds: float, what: str) -> T:
    """`asyncio.wait_for` at this machine's pace, saying what it waited for (built on
    `within`: 3.11's wait_for can swallow a cancellation, pyproject's ban says)."""
    async with within(seconds, what):
        return await awaitable


async def until(
    condition: Callable[[], bool | Awaitable[bool]],
    within: float,
    what: str,
    *,
    every: float = 0.01,
) -> None:
    """Returns once `condition()` (or what it returns, awaited) holds, asked every
    `every` s: for state another component keeps, with no event to wait on. A
    TimeoutError after `within` seconds at this machine's pace says what for."""
    async with bounded(scaled(within), what):
        while not await _holds(condition):  # noqa: ASYNC110 - it offers no event
            await asyncio.sleep(every)


async def _holds(condition: Callable[[], bool | Awaitable[bool]]) -> bool:
    held = condition()
    return bool(await held) if inspect.isawaitable(held) else bool(held)


def run(
    args: Sequence[str | os.PathLike[str]] | str, seconds: float, **kwargs: Any
) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run` with a timeout of `seconds` at this machine's pace; one that
    expires fails the test naming the command, the seconds and what it printed by then
    (TimeoutExpired's message leaves that out)."""
    limit = scaled(seconds)
    try:
        return subprocess.run(args, timeout=limit, **kwargs)
    except subprocess.TimeoutExpired as expired:
        raise _still_running(args, limit, expired.stdout, expired.stderr) from None


def communicate(process: subprocess.Popen[Any], seconds: float) -> tuple[Any, Any]:
    """`process.communicate()` with a timeout of `seconds` at this machine's pace; a
    process still running then is killed, and the test fails as with `run`."""
    limit = scaled(seconds)
    try:
        return process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise _still_running(process.args, limit, out, err) from None


def _still_running(args: Any, limit: float, *printed: str | bytes | None) -> AssertionError:
    command = args if isinstance(args, str) else " ".join(str(arg) for arg in args)
    said = "".join(
        (text.decode(errors="replace") if isinstance(text, bytes) else text)[-3000:]
        for text in printed
        if text
    )
    return AssertionError(
        f"waited {limit:.1f} s for {command[:300]} to end; it printed:\n{said or '(nothing)'}"
    )


class Contention:
    """How much of this machine's CPU went elsewhere while a block ran: to processes
    that were already running when it began (other work on the machine, servers left
    by earlier tests), and to the hypervisor (steal time). A timing test measured on a
    machine that is meant to be quiet (CI) uses it to tell a slow plait from a busy
    machine, by CPU time actually received rather than by the load average, which also
    counts the test's own processes.

    `slowness` is the machine's capacity over what was left of it: 1.0 when nothing
    else ran, 2.0 when others took half of it."""

    def __init__(self) -> None:
        self.others = 0.0  # CPU seconds used by processes that predate the block
        self.steal = 0.0  # CPU seconds the hypervisor gave to other machines
        self.wall = 0.0
        self.cores = psutil.cpu_count() or 1
        self._began = 0.0
        self._steal0 = 0.0
        self._before: dict[int, tuple[float, float]] = {}

    def __enter__(self) -> Contention:
        self._began = time.monotonic()
        self._steal0 = _steal()
        self._before = _process_cpu(exclude=os.getpid())
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.monotonic() - self._began
        self.steal = max(0.0, _steal() - self._steal0)
        after = _process_cpu(exclude=os.getpid())
        self.others = sum(
            max(0.0, cpu - self._before[pid][1])
            for pid, (created, cpu) in after.items()
            if pid in self._before and self._before[pid][0] == created
        )

    @property
    def slowness(self) -> float:
        capacity = self.cores * self.wall
        if capacity <= 0:
            return 1.0
        left = max(capacity / MAX_SLOWNESS, capacity - self.others - self.steal)
        return capacity / left

    def __str__(self) -> str:
        return (
            f"others used {self.others:.1f} CPU s and steal took {self.steal:.1f} s of"
            f" {self.cores} cores x {self.wall:.0f} s (slowness {self.slowness:.2f})"
        )


def _steal() -> float:
    return float(getattr(psutil.cpu_times(), "steal", 0.0))


def _process_cpu(exclude: int) -> dict[int, tuple[float, float]]:
    """Every process's (creation time, CPU seconds with its reaped children's)."""
    found: dict[int, tuple[float, float]] = {}
    for proc in psutil.process_iter():
        if proc.pid == exclude:
            continue
        with contextlib.suppress(psutil.Error), proc.oneshot():
            t = proc.cpu_times()
            found[proc.pid] = (
                proc.create_time(),
                t.user + t.system + t.children_user + t.children_system,
            )
    return found
