"""`ddtree-deploy status`: one row per host (reachability, ABI, sglang, overlay, lock, journal, server)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from ddtree_deploy import output as out
from ddtree_deploy.commands._selection import Selection, fleet_command
from ddtree_deploy.fleet import FleetReport, connecting, fan_out

if TYPE_CHECKING:
    from ddtree_deploy.commands._host_status import HostStatus


@fleet_command()
def status(
    selection: Selection,
    as_json: out.JsonOption = False,
) -> None:
    """Show every selected host (default: all): reachable, python, sglang, torch/CUDA, overlay, lock, server.

    Exit codes: 0 all hosts reachable and clean; 1 a host is unreachable; 3 a host is locked, has an
    open journal or a damaged state file, has drifted, runs an overlay no probe verified, or its
    server is unhealthy.
    """
    with out.errors_rendered(as_json):
        inv, hosts = selection.load(default_all=True)
        options = selection.fleet_options()
        with connecting(inv, hosts, "status", options) as started:
            from ddtree_deploy.commands._host_status import host_status  # imported while the hosts connect

            report = fan_out(inv, hosts, "status", host_status, options, started)
    pythons = {h.name: h.python for h in hosts}
    out.emit(report, as_json=as_json, human=partial(render, pythons=pythons), code=status_exit_code(report))


def status_exit_code(report: FleetReport[HostStatus]) -> out.ExitCode:
    if any(row.result is not None and row.result.needs_attention for row in report.hosts):
        return out.ExitCode.HOST_NEEDS_ATTENTION
    return out.ExitCode.FAILED if report.failed else out.ExitCode.OK


def render(report: FleetReport[HostStatus], pythons: dict[str, str] | None = None) -> None:
    """The status table; a host without an answer says why in its server column (`out.no_answer`)."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="ddtree-deploy status", title_justify="left")
    for column in ("host", "python", "sglang", "torch", "overlay", "lock", "server", "notes"):
        table.add_column(column, overflow="fold")
    for row in report.hosts:
        if row.result is None:
            code, message, hint = (row.error.code, row.error.message, row.error.hint) if row.error else \
                ("skipped", "skipped", "")
            why = out.no_answer(code, (pythons or {}).get(row.host, "its python"))
            notes = escape(message.removeprefix(f"{row.host}: ")) + (f"\n[dim]hint: {escape(hint)}[/]" if hint else "")
            table.add_row(row.host, "", "", "", "", "", f"[red]{escape(why)}[/]", f"[red]{notes}[/]")
            continue
        s = row.result
        server = f"[green]{s.server}[/]" if s.server.startswith("healthy") else s.server
        overlay = f"{s.overlay} [yellow](unverified)[/]" if s.verified is False else s.overlay or "none"
        table.add_row(s.host, s.python, s.sglang or "[red]missing[/]", s.torch or "-", overlay,
                      s.lock or "-", server, "; ".join(s.notes))
    out.console.print(table)
