"""The documentation site builds with `mkdocs build --strict` (a broken link, a missing
page or a reference that does not resolve fails it), and its generated references
cover the code: every command of `plait`, every configuration key."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

import pace
from plait.cli import main
from plait.config import InstanceConfig

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_build_strictly_and_their_references_cover_the_code(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = pace.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        300,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert isinstance(main, click.Group)
    for name in main.commands:
        assert f"plait {name}" in cli, f"the CLI reference lacks `plait {name}`"
    configuration = (site / "reference" / "configuration" / "index.html").read_text()
    for key in InstanceConfig.model_fields:
        assert f"<code>{key}</code>" in configuration, f"the configuration lacks {key}"
    assert "<!-- plait:configuration -->" not in configuration
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "MultiWriterIdGenerator" in api
    home = (site / "index.html").read_text()
    assert "Quick start" in home
    assert "comes as a pip wheel" in home
