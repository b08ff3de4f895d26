"""The app as a whole: what it registers, what a run imports (measured, not assumed), and what it leaves behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddtree_deploy.cli import app
from ddtree_deploy.commands import version
from ddtree_deploy.history import AUDIT_ENV
from ddtree_deploy.output import reflow
from sandbox.hosts import SandboxHost

Cli = Callable[..., Any]  # the `cli` fixture (tests/conftest.py): runs the app, returns a CliOutcome
REPO = Path(__file__).resolve().parents[2]
#: imported by a command that needs them, never by the CLI itself
HEAVY = ("fabric", "paramiko", "rich", "rich.table", "ddtree_deploy.steps", "ddtree_deploy.overlay",
         "ddtree_deploy.abi", "ddtree_deploy.probing", "ddtree_deploy.playbook", "ddtree_deploy.service",
         "ddtree_deploy.commands._host_status", "ddtree_deploy.commands._abi_matrix")


def imported_by(*argv: str, cwd: Path = REPO) -> set[str]:
    """Modules a `python -X importtime ...` run imported (importtime's report is on stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, env=env, cwd=cwd)
    return {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}


def test_every_command_and_group_is_registered() -> None:
    names = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert names == {"status", "push", "rollback", "restart", "stop", "play", "diff", "adopt", "snapshots", "prune",
                     "history", "abi", "logs", "unlock", "overlay", "bench"}


def test_importing_the_cli_imports_no_command_s_work() -> None:
    imported = imported_by("-c", "import ddtree_deploy.cli")
    assert "ddtree_deploy.cli" in imported
    assert sorted(imported & set(HEAVY)) == []


def test_status_json_on_a_local_host_imports_no_ssh_stack_and_no_rich(
        make_host: Callable[..., SandboxHost], tmp_path: Path) -> None:
    host = make_host("ct129")
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"ct129": host.inventory_entry(transport="local")}}))

    imported = imported_by("-m", "ddtree_deploy.cli", "status", "--json", "--inventory", str(inventory), cwd=tmp_path)

    assert "ddtree_deploy.commands._host_status" in imported  # it did run the status
    assert sorted(imported & {"fabric", "paramiko", "rich", "rich.table"}) == []


def _file_state(path: Path) -> tuple[int, int] | None:
    return (path.stat().st_size, path.stat().st_mtime_ns) if path.exists() else None


def test_a_cli_run_under_the_tests_leaves_the_users_audit_log_alone(
        make_host: Callable[..., SandboxHost], cli: Cli, user_audit_log: Path, tmp_path: Path) -> None:
    before = _file_state(user_audit_log)
    host = make_host("ct129")
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"ct129": host.inventory_entry(transport="local")}}))
    stopped = cli("stop", "--all", "--json", inventory=inventory)
    assert stopped.exit_code == 0, stopped.stdout
    assert _file_state(user_audit_log) == before
    # the run was logged, in this test's own audit log, and `history` reads it back
    assert Path(os.environ[AUDIT_ENV]) != user_audit_log
    shown = cli("history", "--json", inventory=inventory)
    assert shown.exit_code == 0 and [line["command"] for line in shown.json["data"]["audit"]] == ["stop"]


@pytest.mark.parametrize("args", [["status", "--jsn"], ["push", "--all", "--wave-size", "x"],
                                  ["overlay", "check", "--bse", "0.5.17"], ["no-such-verb"]])
def test_a_usage_error_with_json_is_the_error_envelope_on_stdout(cli: Cli,
                                                                 args: list[str]) -> None:
    out = cli(*args, "--json")
    assert (out.exit_code, out.stderr) == (2, "")
    error = out.json["error"]
    assert error["code"] == "usage" and "--help" in error["hint"], error
    assert error["message"].startswith(args[0]) or args[0] == "no-such-verb", error


def test_a_usage_error_without_json_is_one_line_and_its_hint(cli: Cli) -> None:
    out = cli("status", "--jsn")
    assert (out.exit_code, out.stdout) == (2, "")
    assert out.stderr.splitlines() == ["error: status: No such option: --jsn (Possible options: --json)",
                                       "  hint: see `ddtree-deploy status --help`"]


def test_the_console_script_keeps_stderr_empty_on_a_usage_error_with_json() -> None:
    proc = subprocess.run([sys.executable, "-c", "from ddtree_deploy.cli import main; main()", "push", "--all",
                           "--wave-size", "x", "--json"], capture_output=True, text=True, check=False)
    assert (proc.returncode, proc.stderr) == (2, "")
    assert json.loads(proc.stdout)["error"]["code"] == "usage"


def every_command() -> list[list[str]]:
    return [[c.name or ""] for c in app.registered_commands] + [["overlay"], ["overlay", "list"], ["overlay", "check"],
                                                                ["overlay", "export"]]


@pytest.mark.parametrize("command", every_command(), ids=" ".join)
def test_every_help_text_shows_what_it_declares(cli: Cli, command: list[str]) -> None:
    shown = cli(*command, "--help")
    assert shown.exit_code == 0, shown.stderr
    assert "<bool>" not in shown.stdout and "<list" not in shown.stdout and "<int>" not in shown.stdout
    if command in (["push"], ["play"], ["overlay", "check"]):
        assert "NAME[@VERSION]" in shown.stdout  # rich markup would take "[@VERSION]" for a tag and drop it


def test_a_docstring_is_rewrapped_by_paragraph() -> None:
    assert reflow("""First line
        goes on.

        Second paragraph,
        two lines.
    """) == "First line goes on.\n\nSecond paragraph, two lines."


def test_version(cli: Cli) -> None:
    shown = cli("--version")
    assert (shown.exit_code, shown.stdout, shown.stderr) == (0, f"ddtree-deploy {version()}\n", "")
    assert version() == metadata.version("ddtree-deploy")


def test_shell_completion_completes_commands_and_options() -> None:
    def complete(words: str) -> list[str]:
        env = {**os.environ, "_DDTREE_DEPLOY_COMPLETE": "complete_bash",
               "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - 1)}
        proc = subprocess.run([sys.executable, "-m", "ddtree_deploy.cli"], env=env, capture_output=True, text=True,
                              check=True)
        return proc.stdout.split()

    assert complete("ddtree-deploy pu") == ["push"]
    assert complete("ddtree-deploy push --ov") == ["--overlay", "--overlays"]
    script = subprocess.run([sys.executable, "-m", "ddtree_deploy.cli", "--show-completion", "bash"],
                            capture_output=True, text=True)
    assert script.returncode == 0 and "complete -o default -F _ddtree_deploy_completion ddtree-deploy" in script.stdout
