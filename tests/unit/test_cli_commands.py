"""The app registers only the command a run names (so it imports only that command's modules), or all of them."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from ddtree_deploy.cli import build_app
from ddtree_deploy.commands import COMMANDS, GROUPS


def names(verb: str | None) -> set[str]:
    app = build_app(verb)
    return {c.name or "" for c in app.registered_commands} | {g.name or "" for g in app.registered_groups}


def test_a_named_verb_registers_only_itself_and_anything_else_registers_all() -> None:
    everything = {n for _, n in COMMANDS} | {n for _, n in GROUPS}
    assert names("push") == {"push"}
    assert names("overlay") == {"overlay"}
    assert names(None) == names("--help") == names("no-such-verb") == everything


def test_one_registered_command_is_still_a_subcommand() -> None:
    result = CliRunner().invoke(build_app("rollback"), ["rollback", "--help"])
    assert result.exit_code == 0 and "--to" in result.stdout
    typo = CliRunner().invoke(build_app("no-such-verb"), ["no-such-verb"])
    assert typo.exit_code == 2


def test_building_the_push_command_imports_neither_steps_nor_overlays_nor_rich_tables() -> None:
    # push imports those once its hosts are connecting, so that the two overlap
    code = ("import sys; from ddtree_deploy.cli import build_app; build_app('push'); "
            "print(sorted(m for m in ('ddtree_deploy.steps', 'ddtree_deploy.overlay', 'rich.table') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
