"""`python -m plait.cli`, as `plait`."""

from plait.cli import run

run()
