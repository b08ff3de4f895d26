"""`ddtree-deploy prune`: free each host's snapshot store, keeping every snapshot a rollback needs."""

from __future__ import annotations

from typing import Annotated

import typer

from ddtree_deploy import output as out
from ddtree_deploy.fleet import FleetOptions, connecting
from ddtree_deploy.inventory import load_inventory, select_hosts


def prune(
    host: out.HostOption = None,
    group: out.GroupOption = None,
    all_hosts: out.AllOption = False,
    keep: Annotated[int, typer.Option("--keep", min=1, help="Newest snapshots to keep.")] = 5,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; remove nothing.")] = False,
    inventory: out.InventoryOption = None,
    accept_new_host_key: out.AcceptNewHostKeyOption = False,
    as_json: out.JsonOption = False,
) -> None:
    """Remove old snapshots and the stored contents only they use, on the selected hosts.

    Kept: the newest KEEP, the deployed overlay's rollback target and the bases plans read from, so
    `rollback` works as before. The package and the server are not touched. Exit codes as for push.
    """
    with out.errors_rendered(as_json):
        inv = load_inventory(inventory)
        hosts = select_hosts(inv, names=host, groups=group, all_hosts=all_hosts)
        fleet_options = FleetOptions(accept_new_host_key=accept_new_host_key)
        with connecting(inv, hosts, "prune", fleet_options) as started:
            from ddtree_deploy import playbook
            from ddtree_deploy.commands._play import exit_code, render, run_playbook
            from ddtree_deploy.steps import RunOptions

            options = RunOptions(keep_snapshots=keep, dry_run=dry_run)
            report = run_playbook(inv, hosts, playbook.builtin("prune"), options, None, fleet_options,
                                  as_json=as_json, started=started)
    out.emit(report, as_json=as_json, human=render, code=exit_code(report))
