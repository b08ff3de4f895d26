"""`ddtree-deploy history`: what was done to each host (its own history.jsonl) and from here (the audit log)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from pydantic import BaseModel

from ddtree_deploy import history as audit
from ddtree_deploy import output as out
from ddtree_deploy.commands._selection import Selection, fleet_command
from ddtree_deploy.fleet import FleetReport, fan_out
from ddtree_deploy.remote import locks
from ddtree_deploy.transport import Transport
from ddtree_deploy.wording import moment


class HostHistory(BaseModel):
    host: str
    events: list[dict[str, Any]]


class HistoryReport(BaseModel):
    hosts: FleetReport[HostHistory]
    audit: list[dict[str, Any]]


@fleet_command()
def history(
    selection: Selection,
    lines: Annotated[int, typer.Option("-n", metavar="N", help="Events per host, and audit lines.")] = 10,
    as_json: out.JsonOption = False,
) -> None:
    """The last operations on each selected host (default: all), and this machine's audit log."""
    with out.errors_rendered(as_json):
        inv, hosts = selection.load(default_all=True)

        def work(t: Transport) -> HostHistory:
            return HostHistory(host=t.host.name, events=locks.state(t, history=lines).history)

        report = HistoryReport(
            hosts=fan_out(inv, hosts, "history", work, selection.fleet_options()),
            audit=audit.read(lines),
        )
    out.emit(report, as_json=as_json, human=_render,
             code=out.ExitCode.FAILED if report.hosts.failed else out.ExitCode.OK)


def _render(report: HistoryReport) -> None:
    for row in report.hosts.hosts:
        out.console.rule(f"[bold]{row.host}")
        if row.result is None:
            out.print_host_error(row.host, row.error)
            continue
        for event in row.result.events or [{"op": "(no history yet)"}]:
            out.console.print(_event_line(event), soft_wrap=True)
    out.console.rule("[bold]audit log (this machine)")
    for line in report.audit or [{"command": "(empty)"}]:
        hosts = ", ".join(f"{h}: {o}" for h, o in (line.get("hosts") or {}).items())
        out.console.print(f"{_when(line.get('time'))}  {line.get('command')}  {hosts}", soft_wrap=True)


def _event_line(event: dict[str, Any]) -> str:
    rest = {k: v for k, v in event.items() if k not in ("time", "op")}
    detail = ", ".join(f"{k}={v}" for k, v in rest.items() if not isinstance(v, (dict, list)))
    return f"{_when(event.get('time'))}  {event.get('op')}  {detail}"


def _when(ts: Any) -> str:
    return moment(ts) if isinstance(ts, (int, float)) else "-"
