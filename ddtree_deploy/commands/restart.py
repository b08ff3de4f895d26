"""`ddtree-deploy restart` and `stop`: the server alone, through the built-in playbooks of the same names."""

from __future__ import annotations

from collections.abc import Callable

from ddtree_deploy import output as out
from ddtree_deploy.fleet import FleetOptions, connecting
from ddtree_deploy.inventory import load_inventory, select_hosts


def _builtin_playbook_command(name: str, doc: str) -> Callable[..., None]:
    """A command that plays the built-in playbook `name` on the selected hosts, with no options of its own."""

    def command(
        host: out.HostOption = None,
        group: out.GroupOption = None,
        all_hosts: out.AllOption = False,
        inventory: out.InventoryOption = None,
        accept_new_host_key: out.AcceptNewHostKeyOption = False,
        as_json: out.JsonOption = False,
    ) -> None:
        with out.errors_rendered(as_json):
            inv = load_inventory(inventory)
            hosts = select_hosts(inv, names=host, groups=group, all_hosts=all_hosts)
            fleet_options = FleetOptions(accept_new_host_key=accept_new_host_key)
            with connecting(inv, hosts, name, fleet_options) as started:
                # imported once the hosts are connecting, so the two overlap (see push)
                from ddtree_deploy import playbook
                from ddtree_deploy.commands._play import exit_code, render, run_playbook
                from ddtree_deploy.steps import RunOptions

                report = run_playbook(inv, hosts, playbook.builtin(name), RunOptions(), None, fleet_options,
                                      as_json=as_json, started=started)
        out.emit(report, as_json=as_json, human=render, code=exit_code(report))

    command.__doc__ = doc
    command.__name__ = name
    return command


restart = _builtin_playbook_command(
    "restart", "Stop and start the selected hosts' servers (failing fast), then run the inventory's probes.")
stop = _builtin_playbook_command(
    "stop", "Stop the selected hosts' servers: SIGTERM to the whole process group, SIGKILL after the grace period.")
