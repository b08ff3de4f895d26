"""The CLI's commands, one module per verb (or verb group); `register` adds them to the app.

A command module imports at its top only what its signature needs (typer, the shared options); what
its command runs is imported in the command's body, so a run imports only its own command's work.
"""

from __future__ import annotations

import typer

from ddtree_deploy.commands import (
    abi,
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


def register(app: typer.Typer) -> None:
    """Add every command and command group to `app`."""
    for command in (status.status, push.push, rollback.rollback, restart.restart, restart.stop, play.play,
                    diff.diff, snapshots.snapshots, prune.prune, history.history, abi.abi, logs.logs, unlock.unlock,
                    bench.bench):
        app.command(command.__name__)(command)
    app.add_typer(overlay.app, name="overlay")
