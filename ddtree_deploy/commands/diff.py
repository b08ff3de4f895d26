"""`ddtree-deploy diff`: drift, file by file, between installed files and what each host's state says.

With `--content`, each drifted file also comes as a unified diff from the bytes the host's store
holds (what was deployed) to the installed bytes: what `adopt` would accept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ddtree_deploy import output as out
from ddtree_deploy.commands._selection import Selection, fleet_command
from ddtree_deploy.fleet import FleetReport, fan_out
from ddtree_deploy.wording import plural

if TYPE_CHECKING:
    from ddtree_deploy.remote.drift import DriftReport
    from ddtree_deploy.transport import Transport

DeepOption = Annotated[bool, typer.Option("--deep", help="Re-hash every file instead of trusting unchanged stat data.")]
ContentOption = Annotated[bool, typer.Option(
    "--content", help="Show each drifted file as a unified diff against the stored contents (files up to 1 MB).")]


@fleet_command()
def diff(
    selection: Selection,
    deep: DeepOption = False,
    content: ContentOption = False,
    as_json: out.JsonOption = False,
) -> None:
    """Compare installed sglang files with the deployed state (base snapshot plus overlay), file by file.

    Exit codes: 0 no drift anywhere; 1 a host could not be read; 3 a host drifted or has an open journal.
    """
    from ddtree_deploy.remote import drift

    def work(t: Transport) -> DriftReport:
        found = drift.verify(t, deep=deep, content=content)
        return _with_diffs(found) if content else found

    with out.errors_rendered(as_json):
        inv, hosts = selection.load(default_all=True)
        options = selection.fleet_options()
        report = fan_out(inv, hosts, "diff", work, options)
    out.emit(report, as_json=as_json, human=_render, code=diff_exit_code(report))


def _with_diffs(found: DriftReport) -> DriftReport:
    """Each drifted file's unified diff, stored -> installed, where both sides' bytes came (a mode change has none)."""
    from ddtree_deploy.plan import file_diff

    for entry in found.files:
        old, new = entry.expected_content, entry.actual_content
        if entry.kind != "mode" and (entry.expected is None or old is not None) and (entry.actual is None
                                                                                      or new is not None):
            entry.diff = file_diff(entry.path, old, new)
    return found


def diff_exit_code(report: FleetReport[DriftReport]) -> out.ExitCode:
    if any(row.result is not None and (not row.result.clean or row.result.journal_open) for row in report.hosts):
        return out.ExitCode.HOST_NEEDS_ATTENTION
    return out.ExitCode.FAILED if report.failed else out.ExitCode.OK


def _render(report: FleetReport[DriftReport]) -> None:
    from rich.table import Table

    for row in report.hosts:
        if row.result is None:
            out.print_host_error(row.host, row.error)
            continue
        drift = row.result
        against = f"snapshot {drift.baseline}" + (f" + {drift.overlay}" if drift.overlay else "")
        if drift.journal_open:
            out.console.print(f"[bold]{row.host}[/]: [red]open journal[/]: an operation was interrupted; "
                          f"run `ddtree-deploy rollback --host {row.host}`")
        if drift.baseline is None:
            out.console.print(f"[bold]{row.host}[/]: nothing deployed yet, nothing to compare")
        elif drift.clean:
            out.console.print(f"[bold]{row.host}[/]: [green]no drift[/] ({plural(drift.checked, 'file')} against {against})")
        else:
            table = Table(title=f"{row.host}: {plural(len(drift.files), 'file')} drifted from {against}",
                          title_justify="left")
            for column in ("path", "change", "expected", "found"):
                table.add_column(column, overflow="fold")
            for entry in drift.files:
                table.add_row(entry.path, entry.kind, _short(entry.expected), _short(entry.actual))
            out.console.print(table)
            _render_contents(drift)


def _render_contents(drift: DriftReport) -> None:
    from rich.markup import escape

    for entry in drift.files:
        if entry.diff:
            out.console.print(entry.diff, markup=False, highlight=False, soft_wrap=True, end="")
        if entry.content_note:
            out.console.print(f"[dim]{escape(entry.path)}: not shown: {escape(entry.content_note)}[/]")


def _short(entry: dict[str, object] | None) -> str:
    if entry is None:
        return "(absent)"
    mode = entry.get("mode")
    return f"{str(entry.get('sha256'))[:12]} {oct(mode) if isinstance(mode, int) else ''}".strip()
