"""`ddtree-deploy push`: preflight, plan, reference, snapshot, apply, restart, probe; roll back on failure."""

from __future__ import annotations

from typing import Annotated

import typer

from ddtree_deploy import output as out
from ddtree_deploy.commands._builtin import play_builtin

OverlayOption = Annotated[str, typer.Option("--overlay", "-o", help="NAME[@VERSION]; default: newest version.")]
OverlaysDirOption = Annotated[
    str | None, typer.Option("--overlays", envvar="DDTREE_OVERLAYS", help="Overlays folder (default ./overlays).")
]
WaveOption = Annotated[int, typer.Option("--wave-size", help="Hosts per wave (0: all at once).")]
MaxFailOption = Annotated[
    int | None, typer.Option("--max-failures", help="Start no further wave once more hosts than this failed.")
]


def push(
    host: out.HostOption = None,
    group: out.GroupOption = None,
    all_hosts: out.AllOption = False,
    overlay: OverlayOption = "ddtree",
    overlays: OverlaysDirOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan as a diff; change nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Push over drifted files.")] = False,
    no_rollback: Annotated[bool, typer.Option("--no-rollback", help="On failure, leave the host as it failed.")] = False,
    wave_size: WaveOption = 0,
    max_failures: MaxFailOption = None,
    inventory: out.InventoryOption = None,
    accept_new_host_key: out.AcceptNewHostKeyOption = False,
    as_json: out.JsonOption = False,
) -> None:
    """Deploy an overlay to the selected hosts, in parallel; any failure after the snapshot rolls back.

    Exit codes: 0 applied (or already applied, or dry run); 1 refused before any change, or failed
    and rolled back with the host healthy; 2 bad input; 3 a host is left unhealthy, locked or with an
    open journal.
    """
    play_builtin("push", host=host, group=group, all_hosts=all_hosts, inventory=inventory,
                 accept_new_host_key=accept_new_host_key, as_json=as_json, wave_size=wave_size,
                 max_failures=max_failures, overlay=overlay, overlays_dir=overlays, dry_run=dry_run, force=force,
                 no_rollback=no_rollback)
