"""The `ddtree-deploy` command line: assembles the Typer app from the command modules.

Each command lives in `commands/<verb>.py`, builds a result model through `fleet`, and renders it
with `output.emit` (rich for people, one `{"data": ...}` envelope with `--json`). Exit codes are
`output.ExitCode`, documented in README.md.
"""

from __future__ import annotations

import sys

import typer

from ddtree_deploy.commands import register, root
from ddtree_deploy.output import Group, run_app

app = typer.Typer(
    name="ddtree-deploy",
    help="Snapshot, patch, restart and roll back the installed sglang package on a fleet of GPU hosts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    cls=Group,  # help texts as written (output.Command)
)
app.callback()(root)  # --version
register(app)


def main() -> None:
    sys.exit(run_app(app, sys.argv[1:]))  # run_app renders usage errors as every other error


if __name__ == "__main__":
    main()
