"""`python -m plait`: the `plait` command."""

from plait.cli import run

run()
