"""`ddtree-deploy status`: one row per host (reachability, ABI, sglang, overlay, lock, journal, server)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddtree_deploy import output as out
from ddtree_deploy.fleet import FleetOptions, FleetReport, connecting, fan_out
from ddtree_deploy.inventory import load_inventory, select_hosts

if TYPE_CHECKING:
    from ddtree_deploy import steps


def status(
    host: out.HostOption = None,
    group: out.GroupOption = None,
    all_hosts: out.AllOption = False,
    inventory: out.InventoryOption = None,
    accept_new_host_key: out.AcceptNewHostKeyOption = False,
    as_json: out.JsonOption = False,
) -> None:
    """Show every selected host (default: all): reachable, python, sglang, torch/CUDA, overlay, lock, server.

    Exit codes: 0 all hosts reachable and clean; 1 a host is unreachable; 3 a host is locked, has an
    open journal, has drifted or its server is unhealthy.
    """
    with out.errors_rendered(as_json):
        inv = load_inventory(inventory)
        hosts = select_hosts(inv, names=host, groups=group, all_hosts=all_hosts, default_all=True)
        options = FleetOptions(accept_new_host_key=accept_new_host_key)
        with connecting(inv, hosts, "status", options) as started:
            from ddtree_deploy import steps  # imported while the hosts connect: the two overlap

            report = fan_out(inv, hosts, "status", steps.host_status, options, started)
    out.emit(report, as_json=as_json, human=_render, code=status_exit_code(report))


def status_exit_code(report: FleetReport[steps.HostStatus]) -> out.ExitCode:
    if any(row.result is not None and row.result.needs_attention for row in report.hosts):
        return out.ExitCode.HOST_NEEDS_ATTENTION
    return out.ExitCode.FAILED if report.failed else out.ExitCode.OK


def _render(report: FleetReport[steps.HostStatus]) -> None:
    from rich.table import Table

    table = Table(title="ddtree-deploy status", title_justify="left")
    for column in ("host", "python", "sglang", "torch", "overlay", "lock", "server", "notes"):
        table.add_column(column, overflow="fold")
    for row in report.hosts:
        if row.result is None:
            message = row.error.message if row.error else "skipped"
            table.add_row(row.host, "", "", "", "", "", "[red]unreachable[/]", f"[red]{message}[/]")
            continue
        s = row.result
        server = f"[green]{s.server}[/]" if s.server.startswith("healthy") else s.server
        table.add_row(s.host, s.python, s.sglang or "[red]missing[/]", s.torch or "-", s.overlay or "none",
                      s.lock or "-", server, "; ".join(s.notes))
    out.console.print(table)
