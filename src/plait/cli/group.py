"""The `plait` command group, which every command module adds its commands to."""

from __future__ import annotations

import click


@click.group(invoke_without_command=True)
@click.version_option(package_name="plait", message="plait %(version)s")
@click.pass_context
def main(ctx: click.Context) -> None:
    """plait: multi-writer ordered streams on PostgreSQL."""
    if ctx.invoked_subcommand is None:  # bare `plait`: what there is, not an error
        click.echo(ctx.get_help())
