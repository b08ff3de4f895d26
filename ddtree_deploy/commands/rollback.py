"""`ddtree-deploy rollback`: restore a snapshot exactly, restart, probe."""

from __future__ import annotations

from typing import Annotated

import typer

from ddtree_deploy import output as out
from ddtree_deploy.commands._builtin import play_builtin
from ddtree_deploy.commands._selection import Selection, fleet_command
from ddtree_deploy.commands.push import OverlaysDirOption


@fleet_command()
def rollback(
    selection: Selection,
    to: Annotated[str | None, typer.Option("--to", metavar="SNAPSHOT", help="Snapshot id (default: the one the overlay sits on).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Restore across a changed torch/CUDA/python.")] = False,
    overlays: OverlaysDirOption = None,
    as_json: out.JsonOption = False,
) -> None:
    """Put each selected host's package back as a snapshot recorded it (say which: --host, --group or --all).

    Hosts with nothing deployed and no interrupted operation are left alone, their servers too. With a
    damaged state.json or journal.json only --to says what to restore (the restore rewrites them).
    Exit codes as for push; an unknown --to snapshot is bad input (2) and touches nothing.
    """
    play_builtin("rollback", selection, as_json=as_json,
                 to_snapshot=to, force=force, overlays_dir=overlays)
