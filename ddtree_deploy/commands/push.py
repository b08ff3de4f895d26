"""`ddtree-deploy push`: preflight, plan, reference, snapshot, apply, restart, probe; roll back on failure."""

from __future__ import annotations

from typing import Annotated

import typer

from ddtree_deploy import output as out
from ddtree_deploy.commands._builtin import play_builtin
from ddtree_deploy.commands._selection import Selection, fleet_command
from ddtree_deploy.fleet import ALL_AT_ONCE, DEFAULT_FORKS, Amount

OverlayOption = Annotated[str, typer.Option("--overlay", "-o", metavar="NAME[@VERSION]",
                                                     help="Overlay to push (without @VERSION: its newest release; a pre-release only by name).")]
OverlaysDirOption = Annotated[
    str | None, typer.Option("--overlays", metavar="DIR",
                               help="Overlays folder, searched before $DDTREE_OVERLAYS, ./overlays, the built-ins.")
]
WaveOption = Annotated[Amount, typer.Option(
    "--wave-size", parser=Amount.parse, metavar="N|N%",
    help="Hosts per wave, or a percentage of the selected hosts (rounded down, at least 1); 0: all at once.")]
MaxFailOption = Annotated[Amount | None, typer.Option(
    "--max-failures", parser=Amount.parse, metavar="N|N%",
    help="Start no further wave once more than N hosts failed (refused, rolled back, failed, unreachable), "
         "or more than N% of the wave just finished.")]
ForksOption = Annotated[int, typer.Option("--forks", min=1, metavar="N", help="Hosts at once within a wave.")]


@fleet_command()
def push(
    selection: Selection,
    overlay: OverlayOption = "ddtree",
    overlays: OverlaysDirOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan as a diff; change nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Push over drifted files.")] = False,
    no_rollback: Annotated[bool, typer.Option("--no-rollback", help="On failure, leave the host as it failed.")] = False,
    wave_size: WaveOption = ALL_AT_ONCE,
    max_failures: MaxFailOption = None,
    forks: ForksOption = DEFAULT_FORKS,
    as_json: out.JsonOption = False,
) -> None:
    """Deploy an overlay to the selected hosts, in parallel; any failure after the snapshot rolls back.

    A canary is `--wave-size 1 --max-failures 0`; Ctrl-C stops every host at its next safe point,
    rolls back where a snapshot was taken, prints the report and exits 130.

    Exit codes: 0 applied (or already applied, or dry run); 1 refused before any change, or failed
    and rolled back with the host healthy; 2 bad input; 3 a host is left unhealthy, locked, with an
    open journal or with a damaged state file; 130 Ctrl-C.
    """
    play_builtin("push", selection, as_json=as_json, wave_size=wave_size,
                 max_failures=max_failures, forks=forks, overlay=overlay, overlays_dir=overlays, dry_run=dry_run, force=force,
                 no_rollback=no_rollback)
