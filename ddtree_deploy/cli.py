"""The `ddtree-deploy` command line: assembles the Typer app from the command modules.

Each command lives in `commands/<verb>.py`, builds a result model through `fleet`, and renders it
with `output.emit` (rich for people, one `{"data": ...}` envelope with `--json`). Exit codes are
`output.ExitCode`, documented in README.md.
"""

from __future__ import annotations

import typer

from ddtree_deploy.commands import register

app = typer.Typer(
    name="ddtree-deploy",
    help="Snapshot, patch, restart and roll back the installed sglang package on a fleet of GPU hosts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
