"""Spark servers on this machine, started from the installed PySpark and bound to
127.0.0.1: a standalone cluster (a master and one worker, 1 core, 1 GiB; real separate
JVMs, so the driver, the executors and their Python workers are separate processes, as
on a cluster), and a Spark Connect server."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyspark

import pace
from plait.ports import free_port
from plait.spark.session import ensure_java

SPARK_HOME = Path(pyspark.__file__).parent
START_WITHIN = 120.0


@dataclass
class Cluster:
    master: str  # spark://127.0.0.1:port
    logs: Path
    worker_pid: int  # the worker's JVM: executors are its children

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(self.logs.glob("*")))


def _spark_env(work: Path) -> dict[str, str]:
    ensure_java()  # JAVA_HOME: the wrapper plait's own sessions use
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env.update(
        SPARK_HOME=str(SPARK_HOME),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_WORKER_DIR=str(work / "worker"),
        SPARK_LOCAL_DIRS=str(work / "local"),
        SPARK_LOG_DIR=str(work / "logs"),
    )
    return env


def _wait(log: Path, word: str, process: subprocess.Popen[bytes], what: str) -> None:
    limit = pace.scaled(START_WITHIN)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if word in log.read_text(errors="replace"):
            return
        if process.poll() is not None:
            break
        time.sleep(0.2)
    raise TimeoutError(
        f"waited {limit:.1f} s for the {what} to say {word!r}; its log ends:\n"
        + log.read_text(errors="replace")[-3000:]
    )


@contextlib.contextmanager
def standalone_cluster(work: Path, cores: int = 1, memory: str = "1g") -> Iterator[Cluster]:
    """A master and a worker (`cores`, `memory`) of the installed PySpark; both stopped
    at the end."""
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    env = _spark_env(work)
    port = free_port()
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    processes: list[subprocess.Popen[bytes]] = []
    try:

        def start(name: str, args: list[str], ready: str) -> None:
            log = logs / f"{name}.log"
            process = subprocess.Popen(
                [spark_class, *args, "--host", "127.0.0.1", "--webui-port", str(free_port())],
                env=env,
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            processes.append(process)
            _wait(log, ready, process, name)

        start(
            "master",
            ["org.apache.spark.deploy.master.Master", "--port", str(port)],
            "I have been elected leader",
        )
        url = f"spark://127.0.0.1:{port}"
        worker = ["org.apache.spark.deploy.worker.Worker", url, "--cores", str(cores)]
        start("worker", [*worker, "--memory", memory], "Successfully registered with master")
        yield Cluster(url, logs, processes[-1].pid)
    finally:
        _stop(processes)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """End each process's group (last started first): TERM, then KILL after 30 s."""
    for process in reversed(processes):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            process.wait()


@dataclass
class ConnectServer:
    url: str  # sc://127.0.0.1:port
    log: Path


@contextlib.contextmanager
def connect_server(work: Path) -> Iterator[ConnectServer]:
    """A Spark Connect server (local[2], task retries on) whose Python workers run this
    Python, where plait is installed: the Connect route of
    docs/guides/spark-clusters.md. Stopped at the end."""
    work.mkdir(parents=True, exist_ok=True)
    env = _spark_env(work)
    env["PYSPARK_PYTHON"] = sys.executable
    port = free_port()
    log = work / "connect-server.log"
    command = [
        str(SPARK_HOME / "bin" / "spark-submit"),
        "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
        "--master", "local[2,4]",
        "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf", f"spark.connect.grpc.binding.port={port}",
        "--conf", "spark.ui.enabled=false",
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=work,
    )
    try:
        _wait(log, "Spark Connect server started at", process, "Spark Connect server")
        yield ConnectServer(f"sc://127.0.0.1:{port}", log)
    finally:
        _stop([process])
