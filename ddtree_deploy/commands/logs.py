"""`ddtree-deploy logs`: the server's log on the selected hosts: the last N lines, or followed as it grows."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from ddtree_deploy import output as out
from ddtree_deploy.commands._selection import Selection, fleet_command
from ddtree_deploy.errors import UsageError
from ddtree_deploy.fleet import FleetReport, fan_out, operator
from ddtree_deploy.inventory import HostSpec, Inventory
from ddtree_deploy.transport import Transport, transport_for

if TYPE_CHECKING:
    from ddtree_deploy.remote.service import LogChunk


@fleet_command()
def logs(
    selection: Selection,
    lines: Annotated[int, typer.Option("--lines", "-n", min=0, metavar="N", help="How many of the last lines to show.")] = 40,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.1, metavar="SECONDS", help="Seconds between reads with --follow.")] = 1.0,
    as_json: out.JsonOption = False,
) -> None:
    """Show the server log of the selected hosts (process log file, or the unit's journal for systemd).

    With several hosts every line is prefixed with its host. Exit codes: 0 shown; 1 a host failed.
    """
    from ddtree_deploy import service

    with out.errors_rendered(as_json):
        if follow and as_json:
            raise UsageError("--follow streams text and cannot be combined with --json",
                             hint="drop --follow to get the last lines as JSON")
        inv, hosts = selection.load()
        report = fan_out(inv, hosts, "logs", lambda t: service.logs(t, n=lines),
                         selection.fleet_options())
    code = out.ExitCode.FAILED if report.failed else out.ExitCode.OK
    if not follow:
        out.emit(report, as_json=as_json, human=_render, code=code)
    _render(report)
    _follow(inv, hosts, report, interval, selection.accept_new_host_key)


def _render(report: FleetReport[LogChunk]) -> None:
    prefix = len(report.hosts) > 1
    for row in report.hosts:
        if row.result is None:
            out.print_host_error(row.host, row.error)
        else:
            _print_lines(row.host, row.result.text.splitlines(), prefix)


def _print_lines(host: str, lines: list[str], prefix: bool) -> None:
    for line in lines:  # out.console.out: a log line is text, never rich markup
        out.console.out(f"{host} | {line}" if prefix else line, highlight=False)


def _follow(inv: Inventory, hosts: list[HostSpec], report: FleetReport[LogChunk], interval: float,
            accept_new_host_key: bool) -> NoReturn:
    """Poll each host for what its log gained since the last read; print whole lines only."""
    from ddtree_deploy import service

    by_name = {h.name: h for h in hosts}
    owner = operator("logs")
    followed: dict[str, tuple[Transport, Any]] = {
        row.host: (transport_for(by_name[row.host], inv.ssh, owner, accept_new_host_key), row.result.offset)
        for row in report.hosts if row.result is not None
    }
    partial = dict.fromkeys(followed, "")
    prefix = len(report.hosts) > 1
    with out.errors_rendered(False):
        try:
            while True:
                time.sleep(interval)
                for name, (transport, offset) in followed.items():
                    chunk = service.logs(transport, offset=offset)
                    followed[name] = (transport, chunk.offset)
                    *complete, partial[name] = (partial[name] + chunk.text).split("\n")
                    _print_lines(name, complete, prefix)
        except KeyboardInterrupt:  # how a follow ends: not an interruption of anything
            raise typer.Exit(int(out.ExitCode.OK)) from None
        finally:
            for transport, _ in followed.values():
                transport.close()
