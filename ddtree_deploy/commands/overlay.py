"""`ddtree-deploy overlay list|check|export`: the overlays found, whether their patches still apply and
compile, and one version written out whole.

Registration (commands/__init__.py): GROUPS += [("overlay", "overlay")] (this module exposes `app`).
Overlays are looked up in `--overlays DIR`, $DDTREE_OVERLAYS, ./overlays, then the built-ins (catalog.py).
`export` imports no SSH stack: the GPU machine runs it to patch a package by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ddtree_deploy import output as out
from ddtree_deploy.wording import plural

if TYPE_CHECKING:  # the command bodies import what they use: the CLI's start stays cheap
    from ddtree_deploy.catalog import OverlayList, OverlaySearch
    from ddtree_deploy.overlay import Overlay, OverlayExport
    from ddtree_deploy.pristine import OverlayCheckReport

app = typer.Typer(help="Overlays: list them; check their patches against pristine sglang releases; export one.",
                  no_args_is_help=True, cls=out.Group)

OverlaysOption = Annotated[
    str | None,
    typer.Option("--overlays", metavar="DIR",
                 help="Folder of overlays, searched before $DDTREE_OVERLAYS, ./overlays and the built-ins."),
]


@app.command("list", cls=out.Command)
def list_command(overlays: OverlaysOption = None, as_json: out.JsonOption = False) -> None:
    """Show every overlay version: its parent, where it came from, supported sglang releases, files, patches,
    artifacts, description.

    Exit codes: 0 all valid; 2 an overlay version is invalid (its row says why).
    """
    from ddtree_deploy.catalog import OverlayList, list_overlays, overlays_path

    with out.errors_rendered(as_json):
        search = overlays_path(overlays)
        result = OverlayList(folders=search.folders, overlays=list_overlays(search))
    broken = any(row.error for row in result.overlays)
    out.emit(result, as_json=as_json, human=_render_list, code=out.ExitCode.BAD_INPUT if broken else out.ExitCode.OK)


@app.command("check", cls=out.Command)
def check_command(
    spec: Annotated[str | None, typer.Argument(metavar="NAME[@VERSION]",
                                               help="Overlay to check (default: every version of every overlay).")]
    = None,
    base: Annotated[list[str] | None, typer.Option(
        "--base", metavar="VERSION", help="sglang release to check against (repeatable; default: the overlay's bases). "
                       "A release the overlay does not support yet gets its newest patch set (a rebase check).")]
    = None,
    overlays: OverlaysOption = None,
    as_json: out.JsonOption = False,
) -> None:
    """Apply each patch set to its pristine release (downloaded once with pip), report conflicts by file and
    hunk, and byte-compile the result.

    Exit codes: 0 everything applies and compiles; 1 a conflict or a compile error; 2 a bad overlay.
    """
    from ddtree_deploy.catalog import load_overlay, overlays_path
    from ddtree_deploy.pristine import OverlayCheckReport, check_overlay

    with out.errors_rendered(as_json):
        search = overlays_path(overlays)
        targets = [load_overlay(spec, search)] if spec else _every_version(search)
        with out.progress("applying patches to pristine releases", as_json):
            checks = [check_overlay(overlay, base) for overlay in targets]
    report = OverlayCheckReport(ok=all(c.ok for c in checks), checks=checks)
    out.emit(report, as_json=as_json, human=_render_check, code=out.ExitCode.OK if report.ok else out.ExitCode.FAILED)


@app.command("export", cls=out.Command)
def export_command(
    spec: Annotated[str, typer.Argument(metavar="NAME[@VERSION]", help="Overlay version (default: the newest release).")],
    folder: Annotated[Path, typer.Argument(help="New (or empty) folder to write the version into.")],
    overlays: OverlaysOption = None,
    as_json: out.JsonOption = False,
) -> None:
    """Write one version, resolved through its parents, as a folder of its own: overlay.yaml (without
    `inherits`), files/, patches/, files-<cuda>/. For patching a package by hand (tools/gpu/apply_overlay.sh).

    Exit codes: 0 written; 2 an unknown or invalid overlay, or a folder that is not empty.
    """
    from ddtree_deploy.catalog import load_overlay, overlays_path
    from ddtree_deploy.overlay import OverlayExport, export

    with out.errors_rendered(as_json):
        overlay = load_overlay(spec, overlays_path(overlays))
        result = OverlayExport(overlay=overlay.label, folder=str(folder), files=export(overlay, folder))
    out.emit(result, as_json=as_json, human=_render_export)


def _render_export(result: OverlayExport) -> None:
    from rich.markup import escape

    out.console.print(f"{result.overlay}: {plural(len(result.files), 'file')} written to {escape(result.folder)}")


def _every_version(search: OverlaySearch) -> list[Overlay]:
    from ddtree_deploy.catalog import OVERLAYS_ENV, list_overlays, load_overlay
    from ddtree_deploy.errors import OverlayError

    rows = list_overlays(search)
    if not rows:
        raise OverlayError(f"no overlays in {search.describe()}", code="unknown_overlay",
                           hint=f"pass --overlays DIR or set {OVERLAYS_ENV}")
    return [load_overlay(f"{row.name}@{row.version}", search) for row in rows]


def _render_list(result: OverlayList) -> None:
    from rich.markup import escape
    from rich.table import Table

    searched = ", ".join(f"{escape(str(f.path))} ({f.origin})" for f in result.folders) or "nothing"
    table = Table(title=f"overlays (searched: {searched})", title_justify="left")
    for column in ("overlay", "inherits", "from", "bases", "files", "patches", "holds", "artifacts", "description"):
        table.add_column(column, overflow="fold")
    for row in result.overlays:
        label, source = f"{row.name}@{row.version}" + (" (default)" if row.default else ""), row.origin
        if row.error:
            table.add_row(label, "", source, "", "", "", "", "", f"[red]invalid: {escape(row.error)}[/]")
        else:
            table.add_row(label, row.inherits or "-", source, ", ".join(row.bases), str(row.files), str(row.patches),
                          str(row.holds), ", ".join(row.artifacts) or "-", escape(row.description))
    out.console.print(table)


def _render_check(report: OverlayCheckReport) -> None:
    from rich.markup import escape

    for check in report.checks:
        for base in check.bases:
            source = f" (patches from {base.patches_from})" if base.patches_from != base.base else ""
            head = f"{check.overlay}@{check.version} on sglang {base.base}{source}"
            if base.ok:
                out.console.print(f"[green]ok[/] {head}: {plural(len(base.patched), 'patch')} applied, "
                                  f"{plural(base.compiled, 'file')} compile")
            else:
                out.console.print(f"[red]FAILED[/] {head}")
            for conflict in base.conflicts:
                out.console.print(f"  conflict: {escape(conflict.text())}")
            for error in base.compile_errors:
                out.console.print(f"  does not compile: {escape(error)}")
            for note in base.notes:
                out.console.print(f"  [dim]note: {escape(note)}[/]")
