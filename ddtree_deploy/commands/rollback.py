"""`ddtree-deploy rollback`: restore a snapshot exactly, restart, probe."""

from __future__ import annotations

from typing import Annotated

import typer

from ddtree_deploy import output as out
from ddtree_deploy.commands.push import OverlaysDirOption
from ddtree_deploy.fleet import FleetOptions, connecting
from ddtree_deploy.inventory import load_inventory, select_hosts


def rollback(
    host: out.HostOption = None,
    group: out.GroupOption = None,
    all_hosts: out.AllOption = False,
    to: Annotated[str | None, typer.Option("--to", help="Snapshot id (default: the one the overlay sits on).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Restore across a changed torch/CUDA/python.")] = False,
    overlays: OverlaysDirOption = None,
    inventory: out.InventoryOption = None,
    accept_new_host_key: out.AcceptNewHostKeyOption = False,
    as_json: out.JsonOption = False,
) -> None:
    """Put each selected host's package back as a snapshot recorded it (default: every host).

    Hosts with nothing deployed and no interrupted operation are left alone. Exit codes as for push.
    """
    with out.errors_rendered(as_json):
        inv = load_inventory(inventory)
        hosts = select_hosts(inv, names=host, groups=group, all_hosts=all_hosts, default_all=True)
        fleet_options = FleetOptions(accept_new_host_key=accept_new_host_key)
        with connecting(inv, hosts, "rollback", fleet_options) as started:
            # imported once the hosts are connecting, so the two overlap (see push)
            from ddtree_deploy import playbook
            from ddtree_deploy.commands._play import exit_code, render, run_playbook
            from ddtree_deploy.steps import RunOptions

            options = RunOptions(to_snapshot=to, force=force, overlays_dir=overlays)
            report = run_playbook(inv, hosts, playbook.builtin("rollback"), options, None, fleet_options,
                                  as_json=as_json, started=started)
    out.emit(report, as_json=as_json, human=render, code=exit_code(report))
