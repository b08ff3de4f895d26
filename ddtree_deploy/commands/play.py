"""`ddtree-deploy play FILE`: run a playbook of one's own (or a built-in one by name)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ddtree_deploy import output as out
from ddtree_deploy.commands._selection import Selection, fleet_command
from ddtree_deploy.commands.push import OverlaysDirOption


@fleet_command()
def play(
    file: Annotated[str, typer.Argument(metavar="FILE", help="Playbook YAML, or the name of a built-in (push, rollback, restart).")],
    selection: Selection,
    overlay: Annotated[str | None, typer.Option("--overlay", "-o", metavar="NAME[@VERSION]",
                                                help="Overlay for plan and apply steps.")] = None,
    overlays: OverlaysDirOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Stop after the plan; change nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Apply over drifted files.")] = False,
    no_rollback: Annotated[bool, typer.Option("--no-rollback", help="Skip on_failure: leave the host as it failed.")]
    = False,
    to: Annotated[str | None, typer.Option("--to", metavar="SNAPSHOT", help="Snapshot id for restore steps.")] = None,
    as_json: out.JsonOption = False,
) -> None:
    """Run a playbook's steps on the selected hosts; unknown steps or arguments are refused before any host is touched."""
    from ddtree_deploy import playbook
    from ddtree_deploy.catalog import load_overlay, overlays_path
    from ddtree_deploy.commands._play import exit_code, render, run_playbook
    from ddtree_deploy.hostrun import RunOptions

    with out.errors_rendered(as_json):
        book = playbook.load_playbook(Path(file)) if Path(file).exists() else playbook.builtin(file)
        inv, hosts = selection.load()
        the_overlay = load_overlay(overlay, overlays_path(overlays)) if overlay else None
        options = RunOptions(overlay=the_overlay.label if the_overlay else None, overlays_dir=overlays,
                             dry_run=dry_run, force=force, no_rollback=no_rollback, to_snapshot=to)
        report = run_playbook(inv, hosts, book, options, the_overlay,
                              selection.fleet_options(), as_json=as_json)
    out.emit(report, as_json=as_json, human=render, code=exit_code(report))
