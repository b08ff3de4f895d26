"""What push, rollback, restart and play share: running a playbook over the fleet and rendering it.

Ctrl-C while the hosts run stops each at its next safe point (between steps; `on_failure` restores
those with a snapshot), and the report, the audit line and exit code 130 still follow. A second
Ctrl-C changes nothing: a step is never cut short (see `fleet.interruptible`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddtree_deploy import history, playbook
from ddtree_deploy import output as out
from ddtree_deploy.fleet import FleetOptions, FleetReport, fan_out, interruptible, operator
from ddtree_deploy.hostrun import HostRun, RunOptions
from ddtree_deploy.inventory import HostSpec, Inventory
from ddtree_deploy.overlay import Overlay
from ddtree_deploy.playbook import Playbook, PlaybookReport
from ddtree_deploy.transport import Transport

if TYPE_CHECKING:
    from rich.table import Table

#: playbook outcome -> exit code (the worst host decides)
OUTCOME_EXIT = {
    "ok": out.ExitCode.OK, "noop": out.ExitCode.OK, "dry_run": out.ExitCode.OK,
    "refused": out.ExitCode.FAILED, "rolled_back": out.ExitCode.FAILED, "interrupted": out.ExitCode.FAILED,
    "failed": out.ExitCode.HOST_NEEDS_ATTENTION,
}
_STYLE = {"ok": "green", "noop": "green", "dry_run": "cyan", "refused": "yellow", "rolled_back": "yellow",
          "interrupted": "yellow", "failed": "bold red"}
#: outcomes that count against `--max-failures`
FAILED_OUTCOMES = ("refused", "rolled_back", "interrupted", "failed")


def run_playbook(
    inv: Inventory, hosts: list[HostSpec], book: Playbook, options: RunOptions, overlay: Overlay | None,
    fleet_options: FleetOptions, *, as_json: bool, started: dict[str, Transport] | None = None,
) -> FleetReport[PlaybookReport]:
    """Play `book` on every host (waves per `fleet_options`), log it to the audit log, return the report.

    `started`: transports already connecting (`fleet.connecting`), used instead of new ones.
    """
    playbook.require_inputs(book, given={"overlay"} if overlay is not None else set())
    progress = out.StepProgress(enabled=not as_json)
    # The audit line is written inside: a Ctrl-C after the hosts finished must not lose it.
    with interruptible(None if as_json else _interrupt_notice) as cancel:

        def work(transport: Transport) -> PlaybookReport:
            run = HostRun(transport=transport, options=options, overlay=overlay, on_progress=progress.update)
            return playbook.play(book, run, cancel)

        with progress:
            report = fan_out(inv, hosts, book.name, work, fleet_options, started, failure=_failure, cancel=cancel)
        extra: dict[str, Any] = {"interrupted": True} if report.interrupted else {}
        history.record(book.name, operator(book.name), report, overlay=overlay.label if overlay else None, **extra)
    return report


def _failure(result: PlaybookReport) -> str | None:
    """What a host's outcome was if it counts against `--max-failures` ("rolled back"), else None."""
    return result.outcome.replace("_", " ") if result.outcome in FAILED_OUTCOMES else None


def _interrupt_notice(count: int) -> None:
    if count == 1:
        out.err_console.print("[yellow]Ctrl-C[/]: every host stops at its next safe point (between steps) and rolls "
                              "back if its snapshot was taken; the report follows", soft_wrap=True)
    else:
        out.err_console.print("[yellow]Ctrl-C again[/]: still stopping safely (a step is never cut short); Ctrl-\\ "
                              "quits at once and leaves an open transaction to `ddtree-deploy rollback`",
                              soft_wrap=True)


def exit_code(report: FleetReport[PlaybookReport]) -> out.ExitCode:
    if report.interrupted:
        return out.ExitCode.INTERRUPTED  # the report says how each host ended
    codes = [out.ExitCode.OK]
    for row in report.hosts:
        if row.result is not None:
            codes.append(_row_code(row.result))
        elif row.error is not None:
            codes.append(out.ExitCode.HOST_NEEDS_ATTENTION if row.error.code == "locked" else out.ExitCode.FAILED)
    return max(codes)


def _row_code(result: PlaybookReport) -> out.ExitCode:
    failed = next((s for s in result.steps if s.status == "failed"), None)
    if result.outcome == "refused" and failed is not None:
        if failed.bad_input:
            return out.ExitCode.BAD_INPUT
        if failed.code in ("locked", "journal_open", "state_damaged"):
            return out.ExitCode.HOST_NEEDS_ATTENTION
    return OUTCOME_EXIT.get(result.outcome, out.ExitCode.FAILED)


def render(report: FleetReport[PlaybookReport]) -> None:
    """One block per host: the outcome, each step, then the recovery steps if a rollback ran."""
    for row in report.hosts:
        if row.skipped:
            out.console.print(f"[bold]{row.host}[/]: [yellow]skipped[/] ({row.skip_reason or 'not started'})",
                              soft_wrap=True)
            continue
        if row.result is None:
            out.print_host_error(row.host, row.error)
            continue
        r = row.result
        reason = f" (failed at {r.failed_step}: {out.escape(r.reason)})" if r.failed_step else ""
        out.console.print(f"[bold]{r.host}[/]: [{_STYLE.get(r.outcome, 'white')}]{r.outcome}[/]{reason}", soft_wrap=True)
        failed = next((o for o in r.steps if o.status == "failed"), None)
        if failed is not None and failed.hint:
            out.print_hint(failed.hint)  # what to do, as `--json` says it
        out.console.print(_steps_table(r))
        _render_evidence(r)


def _steps_table(r: PlaybookReport) -> Table:
    from rich.table import Table  # human output only: a --json run never imports rich's tables

    table = Table(show_header=True, box=None, padding=(0, 2))
    for column in ("", "step", "status", "seconds", "what happened"):
        table.add_column(column, overflow="fold")
    for phase, outcomes in (("", r.steps), ("recovery", r.recovery)):
        for o in outcomes:
            colour = {"ok": "green", "noop": "dim", "failed": "red", "skipped": "dim"}[o.status]
            table.add_row(phase, o.step, f"[{colour}]{o.status}[/]", f"{o.duration_s:.2f}", out.escape(o.message))
    return table


def _render_evidence(r: PlaybookReport) -> None:
    diff = r.summary.get("diff")
    if diff:
        out.console.print(diff, markup=False, highlight=False, soft_wrap=True)
    tail = _log_tail(r)
    if tail:
        from rich.text import Text

        out.console.print("  [dim]server log, last lines:[/]")
        for line in tail[-15:]:
            out.console.print(Text.assemble(("  | ", "dim"), line), soft_wrap=True)
    if r.outcome in ("rolled_back", "failed"):
        state = "healthy" if r.healthy else ("UNHEALTHY" if r.healthy is False else "health unknown (no service)")
        out.console.print(f"  host is now [bold]{state}[/]")


def _log_tail(r: PlaybookReport) -> list[str]:
    for o in r.steps + r.recovery:
        if o.status == "failed" and o.details.get("log_tail"):
            return list(o.details["log_tail"])
    return []
