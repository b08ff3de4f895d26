"""`ddtree-deploy prune`: free each host's snapshot store, keeping every snapshot a rollback needs."""

from __future__ import annotations

from typing import Annotated

import typer

from ddtree_deploy import output as out
from ddtree_deploy.commands._builtin import play_builtin
from ddtree_deploy.commands._selection import Selection, fleet_command


@fleet_command()
def prune(
    selection: Selection,
    keep: Annotated[int, typer.Option("--keep", min=1, metavar="N", help="Newest snapshots to keep.")] = 5,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; remove nothing.")] = False,
    as_json: out.JsonOption = False,
) -> None:
    """Remove old snapshots and the stored contents only they use, on the selected hosts.

    Kept: the newest KEEP, the deployed overlay's rollback target and the bases plans read from, so
    `rollback` works as before. The package and the server are not touched. Exit codes as for push.
    """
    play_builtin("prune", selection, as_json=as_json, keep_snapshots=keep, dry_run=dry_run)
