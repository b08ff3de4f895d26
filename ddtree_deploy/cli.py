"""The `ddtree-deploy` command line: assembles the Typer app from the command modules.

Each command lives in `commands/<verb>.py`, builds a result model through `fleet`, and renders it
with `output.emit` (rich for people, one `{"data": ...}` envelope with `--json`). Exit codes are
`output.ExitCode`, documented in README.md.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ddtree_deploy import forkserver

if TYPE_CHECKING:
    import typer


def build_app(verb: str | None = None) -> typer.Typer:
    """The app with every command, or with only `verb`'s when it names one (see `commands.register`)."""
    import typer  # not at import: a run that a warm fork server answers never needs it

    from ddtree_deploy.commands import register

    app = typer.Typer(
        name="ddtree-deploy",
        help="Snapshot, patch, restart and roll back the installed sglang package on a fleet of GPU hosts.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )
    app.callback()(_group)  # stays a group of commands even when only one is registered
    register(app, verb)
    return app


def _group() -> None:
    """No option of its own: every option belongs to a command."""


def __getattr__(name: str) -> typer.Typer:
    """`cli.app`: the app with every command (tests and tools that import it get the whole CLI)."""
    if name == "app":
        return build_app()
    raise AttributeError(name)


def main() -> None:
    """A warm fork server runs the command when one is up (see `forkserver`); else this process does."""
    code = forkserver.run_through_server(sys.argv)
    if code is not None:
        sys.exit(code)
    run(sys.argv)


def run(argv: list[str]) -> None:
    # A run builds only the command it names: importing every command's modules would cost more than
    # most commands take.
    build_app(argv[1] if len(argv) > 1 else None)(args=argv[1:])


if __name__ == "__main__":
    main()
