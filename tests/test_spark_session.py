"""How plait's own Spark sessions are set up, without starting Spark."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import pace
from plait.spark.probe import cannot_run
from plait.spark.session import TASK_TRIES, driver_python_problem, with_task_retries


@pytest.mark.parametrize(
    ("master", "expected"),
    [
        ("local", f"local[1,{TASK_TRIES}]"),
        ("local[2]", f"local[2,{TASK_TRIES}]"),
        ("local[*]", f"local[*,{TASK_TRIES}]"),
        (" local[*] ", f"local[*,{TASK_TRIES}]"),
        ("local[2,1]", "local[2,1]"),  # the user chose no retries
        ("local-cluster[2,1,1024]", "local-cluster[2,1,1024]"),
        ("spark://127.0.0.1:7077", "spark://127.0.0.1:7077"),
        ("yarn", "yarn"),
    ],
)
def test_local_masters_retry_failed_tasks_as_a_cluster_does(master: str, expected: str) -> None:
    assert with_task_retries(master) == expected


def test_a_workers_python_the_driver_cannot_start_says_what_to_do(tmp_path: Path) -> None:
    """Spark starts the driver's planning workers with the executors' Python, from the
    driver's folder: a path that exists only inside a packed environment on the
    executors (spark.archives) fails every query there."""
    assert driver_python_problem(sys.executable, tmp_path) is None
    assert driver_python_problem("sh", tmp_path) is None  # a command on PATH
    packed = driver_python_problem("./environment/bin/python", tmp_path)
    assert packed is not None
    assert "does not exist in this folder" in packed
    assert "tar -xzf env.tar.gz -C environment" in packed
    python = tmp_path / "environment" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    assert driver_python_problem("./environment/bin/python", tmp_path) is None  # unpacked
    absent = driver_python_problem("/opt/nowhere/bin/python", tmp_path)
    assert absent is not None
    assert "does not exist on this machine" in absent
    unknown = driver_python_problem("no-such-python-here", tmp_path)
    assert unknown is not None
    assert "is not on PATH" in unknown
    not_runnable = tmp_path / "python.txt"
    not_runnable.write_text("")
    assert driver_python_problem(str(not_runnable), tmp_path) is not None


def test_the_program_spark_could_not_start_is_read_from_its_error() -> None:
    error = (
        "py4j.protocol.Py4JJavaError: An error occurred while calling o54.load.\n"
        ': java.io.IOException: Cannot run program "./environment/bin/python": error=2, '
        "No such file or directory"
    )
    assert cannot_run(error) == "./environment/bin/python"
    assert cannot_run("ModuleNotFoundError: No module named 'plait'") is None


RETRIED = """
import subprocess
import sys
from pathlib import Path
from plait.spark.session import quiet_session

marker = Path(sys.argv[1])
spark = quiet_session("retried", master="local[1]")


def once(x: int) -> int:
    if not marker.exists():  # the first try fails, the second reads on
        marker.touch()
        raise RuntimeError("the first try fails")
    return x


print(spark.sparkContext.parallelize([1, 2, 3], 1).map(once).sum())
spark.stop()
"""


def test_a_task_spark_tries_again_is_one_line_on_the_console(tmp_path: Path) -> None:
    """A failed task Spark runs again (a read whose connection dropped) was Spark's
    ERROR and a 50-line Java and Python trace on the console of `plait export`."""
    done = pace.run(
        [sys.executable, "-c", RETRIED, str(tmp_path / "failed-once")],
        300,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["6"]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Exception in task 0.0" in lines[0]
    assert "RuntimeError: the first try fails (Spark tries a task again" in lines[0]
    assert "spark.task.maxFailures" in lines[0]
