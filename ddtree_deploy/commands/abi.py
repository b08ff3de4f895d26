"""`ddtree-deploy abi`: the fleet's fingerprints side by side, differing fields highlighted, stack problems listed."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Annotated

import typer

from ddtree_deploy import output as out
from ddtree_deploy.commands._selection import Selection, fleet_command
from ddtree_deploy.fleet import FleetReport, fan_out

if TYPE_CHECKING:
    from ddtree_deploy.abi import Fingerprint
    from ddtree_deploy.commands._abi_matrix import AbiMatrix, HostColumn
    from ddtree_deploy.transport import Transport

DeepOption = Annotated[
    bool, typer.Option("--deep", help="Also import torch and sgl_kernel on each host (slow), since metadata can lie.")
]


@fleet_command()
def abi(
    selection: Selection,
    deep: DeepOption = False,
    as_json: out.JsonOption = False,
) -> None:
    """Compare the selected hosts' python, torch/CUDA, sglang stack, driver and GPUs (default: all hosts).

    Exit codes: 0 every host answered and its own stack is consistent; 1 a host's stack is
    inconsistent (a package pins another torch, the driver is too old for the CUDA variant, an
    import fails with --deep) or a host is unreachable.
    """
    from ddtree_deploy.commands._abi_matrix import build_matrix

    with out.errors_rendered(as_json):
        inv, hosts = selection.load(default_all=True)
        with out.progress("reading fingerprints", as_json):
            work = partial(read_fingerprint, deep=deep)
            report = fan_out(inv, hosts, "abi", work, selection.fleet_options())
        matrix = build_matrix(_columns(report))
    out.emit(matrix, as_json=as_json, human=_render, code=out.ExitCode.OK if matrix.consistent else out.ExitCode.FAILED)


def read_fingerprint(transport: Transport, *, deep: bool = False) -> Fingerprint:
    """The per-host work: one `fingerprint` round trip, read into a `Fingerprint`."""
    from ddtree_deploy.abi import Fingerprint
    from ddtree_deploy.remote import facts

    return Fingerprint.from_helper(facts.fingerprint(transport, deep=deep), host=transport.host.name)


def _columns(report: FleetReport[Fingerprint]) -> list[HostColumn]:
    from ddtree_deploy.commands._abi_matrix import HostColumn

    columns = []
    for row in report.hosts:
        error = None
        if row.error is not None:
            error = {"code": row.error.code, "message": row.error.message, "hint": row.error.hint}
        elif row.result is None:
            error = {"code": "skipped", "message": "not reached (stopped after earlier failures)", "hint": ""}
        columns.append(HostColumn(host=row.host, fingerprint=row.result, error=error))
    return columns


def _render(matrix: AbiMatrix) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="ddtree-deploy abi", title_justify="left")
    table.add_column("field")
    for column in matrix.columns:
        why = out.no_answer(column.error["code"]) if column.error else "no answer"
        table.add_column(column.host if column.fingerprint else f"{column.host} [red]({escape(why)})[/]")
    for row in matrix.rows:
        style = "bold yellow" if row.differs else ""
        cells = [_cell(row.values[h]) for h in matrix.hosts]
        label = f"{escape(row.field)} [yellow]*[/]" if row.differs else escape(row.field)
        table.add_row(label, *cells, style=style)
    out.console.print(table)
    if any(row.differs for row in matrix.rows):
        out.console.print("[yellow]*[/] the hosts differ in this field")
    for column in matrix.columns:
        _render_column_problems(column)
    if matrix.consistent:
        out.console.print("[green]every host's stack is consistent[/]")


def _cell(value: str | None) -> str:
    from rich.markup import escape

    return "[dim]-[/]" if value is None else escape(value)


def _render_column_problems(column: HostColumn) -> None:
    from rich.markup import escape

    from ddtree_deploy.abi import errors_of

    if column.error is not None:
        # the message already names the host (DeployError's str)
        out.console.print(f"[red]x {escape(column.error['message'])}[/]", soft_wrap=True)
        if column.error.get("hint"):
            out.console.print(f"  [dim]hint:[/] {escape(column.error['hint'])}", soft_wrap=True)
        return
    for problem in column.problems:
        colour, mark = ("red", "x") if problem.severity == "error" else ("yellow", "!")
        out.console.print(f"[{colour}]{mark} {escape(problem.line())}[/]", soft_wrap=True)
        if problem.hint:
            out.console.print(f"  [dim]hint:[/] {escape(problem.hint)}", soft_wrap=True)
    if not errors_of(column.problems) and column.problems:
        out.console.print(f"[green]{escape(column.host)}: stack consistent (warnings only)[/]")
