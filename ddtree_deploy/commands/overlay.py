"""`ddtree-deploy overlay list|check`: the overlays on disk, and whether their patches still apply and compile.

Overlays are read from `--overlays DIR`, else $DDTREE_OVERLAYS, else ./overlays.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ddtree_deploy import output as out
from ddtree_deploy.errors import OverlayError

if TYPE_CHECKING:
    from ddtree_deploy.overlay import Overlay, OverlayCheckReport, OverlayList

app = typer.Typer(help="Overlays: list them; check their patches against pristine sglang releases.",
                  no_args_is_help=True)

OverlaysOption = Annotated[
    str | None,
    typer.Option("--overlays", envvar="DDTREE_OVERLAYS", help="Folder of overlays (default ./overlays)."),
]


@app.command("list")
def list_command(overlays: OverlaysOption = None, as_json: out.JsonOption = False) -> None:
    """Show every overlay version: description, supported sglang releases, files, patches, artifacts.

    Exit codes: 0 all valid; 2 an overlay version is invalid (its row says why).
    """
    from ddtree_deploy.overlay import OverlayList, list_overlays, overlays_path

    with out.errors_rendered(as_json):
        folder = overlays_path(overlays)
        result = OverlayList(folder=str(folder), overlays=list_overlays(folder))
    broken = any(row.error for row in result.overlays)
    out.emit(result, as_json=as_json, human=_render_list, code=out.ExitCode.BAD_INPUT if broken else out.ExitCode.OK)


@app.command("check")
def check_command(
    spec: Annotated[str | None, typer.Argument(metavar="[NAME[@VERSION]]",
                                               help="Overlay to check (default: every version of every overlay).")]
    = None,
    base: Annotated[list[str] | None, typer.Option(
        "--base", help="sglang release to check against (repeatable; default: the overlay's bases). "
                       "A release the overlay does not support yet gets its newest patch set (a rebase check).")]
    = None,
    overlays: OverlaysOption = None,
    as_json: out.JsonOption = False,
) -> None:
    """Apply each patch set to its pristine release (downloaded once with pip), report conflicts by file and
    hunk, and byte-compile the result.

    Exit codes: 0 everything applies and compiles; 1 a conflict or a compile error; 2 a bad overlay.
    """
    from ddtree_deploy.overlay import OverlayCheckReport, check_overlay, load_overlay, overlays_path

    with out.errors_rendered(as_json):
        folder = overlays_path(overlays)
        targets = [load_overlay(spec, folder)] if spec else _every_version(folder)
        with out.progress("applying patches to pristine releases", as_json):
            checks = [check_overlay(overlay, base) for overlay in targets]
    report = OverlayCheckReport(ok=all(c.ok for c in checks), checks=checks)
    out.emit(report, as_json=as_json, human=_render_check, code=out.ExitCode.OK if report.ok else out.ExitCode.FAILED)


def _every_version(folder: Path) -> list[Overlay]:
    from ddtree_deploy.overlay import OVERLAYS_ENV, list_overlays, read_overlay

    rows = list_overlays(folder)
    if not rows:
        raise OverlayError(f"no overlays in {folder}", code="unknown_overlay",
                           hint=f"pass --overlays DIR or set {OVERLAYS_ENV}")
    return [read_overlay(folder / row.name / row.version) for row in rows]


def _render_list(result: OverlayList) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"overlays in {result.folder}", title_justify="left")
    for column in ("overlay", "bases", "files", "patches", "artifacts", "description"):
        table.add_column(column, overflow="fold")
    for row in result.overlays:
        label = f"{row.name}@{row.version}"
        if row.error:
            table.add_row(label, "", "", "", "", f"[red]invalid: {escape(row.error)}[/]")
        else:
            table.add_row(label, ", ".join(row.bases), str(row.files), str(row.patches),
                          ", ".join(row.artifacts) or "-", escape(row.description))
    out.console.print(table)


def _render_check(report: OverlayCheckReport) -> None:
    from rich.markup import escape

    for check in report.checks:
        for base in check.bases:
            source = f" (patches from {base.patches_from})" if base.patches_from != base.base else ""
            head = f"{check.overlay}@{check.version} on sglang {base.base}{source}"
            if base.ok:
                out.console.print(f"[green]ok[/] {head}: {len(base.patched)} patches applied, {base.compiled} files compile")
            else:
                out.console.print(f"[red]FAILED[/] {head}")
            for conflict in base.conflicts:
                out.console.print(f"  conflict: {escape(conflict.text())}")
            for error in base.compile_errors:
                out.console.print(f"  does not compile: {escape(error)}")
            for note in base.notes:
                out.console.print(f"  [dim]note: {escape(note)}[/]")
