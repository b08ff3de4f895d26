"""`ddtree-deploy snapshots`: each host's snapshots (id, time, reason, files, overlay) and its rollback target."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ddtree_deploy import output as out
from ddtree_deploy.commands._selection import Selection, fleet_command
from ddtree_deploy.fleet import FleetReport, fan_out

if TYPE_CHECKING:
    from ddtree_deploy.remote.store import HostSnapshots


@fleet_command()
def snapshots(
    selection: Selection,
    as_json: out.JsonOption = False,
) -> None:
    """List the snapshots on the selected hosts (default: all), oldest first; `*` marks the rollback target.

    Exit codes: 0 every host answered; 1 a host could not be read.
    """
    from ddtree_deploy.remote import store

    with out.errors_rendered(as_json):
        inv, hosts = selection.load(default_all=True)
        options = selection.fleet_options()
        report = fan_out(inv, hosts, "snapshots", store.snapshots, options)
    out.emit(report, as_json=as_json, human=_render, code=out.ExitCode.FAILED if report.failed else out.ExitCode.OK)


def _render(report: FleetReport[HostSnapshots]) -> None:
    from rich.table import Table

    for row in report.hosts:
        if row.result is None:
            out.print_host_error(row.host, row.error)
            continue
        result = row.result
        table = Table(title=f"{row.host}: deployed {result.deployed or 'nothing'}", title_justify="left")
        for column in ("", "id", "time (UTC)", "reason", "files", "overlay"):
            table.add_column(column)
        for snap in result.snapshots:
            mark = "*" if snap.id == result.rollback_target else ""
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(snap.time))
            table.add_row(mark, snap.id, when, snap.reason, str(snap.files), snap.overlay or "")
        if not result.snapshots:
            table.add_row("", "(none yet)", "", "", "", "")
        out.console.print(table)
