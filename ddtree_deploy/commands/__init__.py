"""The CLI's commands, one module per verb (or verb group); `register` adds them to the app.

A command module imports at its top only what its signature needs (typer, the shared options); what
its command runs is imported in the command's body, so a run imports only its own command's work.
"""

from __future__ import annotations

from importlib import metadata
from typing import Annotated

import typer

from ddtree_deploy import __version__
from ddtree_deploy import output as out
from ddtree_deploy.commands import (
    abi,
    adopt,
    bench,
    diff,
    history,
    logs,
    overlay,
    play,
    prune,
    push,
    restart,
    rollback,
    snapshots,
    status,
    unlock,
)


def version() -> str:
    """The installed distribution's version (the package's own when run from a checkout)."""
    try:
        return metadata.version("ddtree-deploy")
    except metadata.PackageNotFoundError:
        return __version__


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"ddtree-deploy {version()}")
        raise typer.Exit()


def root(
    show_version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                               help="Print the version and exit.")] = False,
) -> None:
    """The app's own options (`--version`); every other option belongs to a command."""


def register(app: typer.Typer) -> None:
    """Add every command and command group to `app`."""
    for command in (status.status, push.push, rollback.rollback, restart.restart, restart.stop, play.play,
                    diff.diff, adopt.adopt, snapshots.snapshots, prune.prune, history.history, abi.abi, logs.logs,
                    unlock.unlock, bench.bench):
        app.command(command.__name__, cls=out.Command)(command)
    app.add_typer(overlay.app, name="overlay")
