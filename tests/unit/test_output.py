"""What people read: hints beside errors, a status row that says why a host gave no answer."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddtree_deploy import output as out
from ddtree_deploy.commands import _play, diff, status
from ddtree_deploy.commands._host_status import HostStatus
from ddtree_deploy.fleet import ErrorInfo, FleetReport, HostRow
from ddtree_deploy.hostrun import StepOutcome
from ddtree_deploy.inventory import load_inventory
from ddtree_deploy.playbook import PlaybookReport
from ddtree_deploy.remote.drift import DriftEntry, DriftReport
from ddtree_deploy.transport import LocalTransport
from sandbox.hosts import SandboxHost

DRIFT_HINT = "see `ddtree-deploy diff --host ct200`; push --force overwrites, rollback restores"


Cli = Callable[..., Any]  # the `cli` fixture (tests/conftest.py): runs the app, returns a CliOutcome


def test_a_refused_push_shows_the_hint_that_json_carries(capsys: pytest.CaptureFixture[str]) -> None:
    refused = StepOutcome(step="preflight", status="failed", code="drift", hint=DRIFT_HINT,
                          message="ct200: 1 file drifted: sglang/srt/server_args.py [modified]")
    report = PlaybookReport(playbook="push", host="ct200", outcome="refused", failed_step="preflight",
                            reason=refused.message, steps=[refused])
    _play.render(FleetReport[PlaybookReport](command="push", hosts=[HostRow(host="ct200", result=report)]))
    shown = capsys.readouterr().out
    assert f"hint: {DRIFT_HINT}" in shown
    assert "[modified]" in shown  # brackets in a message are text, not rich markup


def test_the_status_table_says_why_a_host_gave_no_answer(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        HostRow[HostStatus](host="ct129", error=ErrorInfo(code="host_key_rejected", message="ct129: key refused",
                                                          hint="ssh-keygen -R ct129")),
        HostRow[HostStatus](host="ct200", error=ErrorInfo(code="package_not_found", message="no sglang")),
        HostRow[HostStatus](host="ct300", error=ErrorInfo(code="unreachable", message="cannot connect")),
    ]
    status.render(FleetReport[HostStatus](command="status", hosts=rows), pythons={"ct200": "/opt/env/bin/python3"})
    shown = capsys.readouterr().out
    assert "host key refused" in shown and "hint: ssh-keygen -R ct129" in shown
    assert "no sglang in /opt/env/bin/python3" in shown
    assert shown.count("unreachable") == 1  # ct300 alone


def test_status_of_a_python_without_sglang_says_so(cli: Cli, tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.yaml"
    host = {"transport": "local", "python": sys.executable, "package_root": str(tmp_path), "state_dir": str(tmp_path)}
    inventory.write_text(yaml.safe_dump({"hosts": {"box": host}}))
    out = cli("status", inventory=inventory)
    assert out.exit_code == 1
    assert "no sglang in" in out.stdout and "unreachable" not in out.stdout, out.stdout
    assert "hint: fix the host's package_root" in out.stdout


def test_the_progress_line_shows_each_hosts_step_with_its_seconds_going_up() -> None:
    from rich.console import Console

    now = [100.0]
    progress = out.StepProgress(enabled=False, clock=lambda: now[0])
    assert progress.line() == "starting"
    progress.update("ct200", "restart")
    progress.update("ct129", "probe")
    now[0] += 42
    assert progress.line() == "ct129: probe 42 s | ct200: restart 42 s"
    screen = Console(file=io.StringIO(), width=80)
    screen.print(progress)
    now[0] += 60  # the spinner repaints the same object: the new time shows without an update
    screen.print(progress)
    assert screen.file.getvalue().splitlines() == ["ct129: probe 42 s | ct200: restart 42 s",
                                                   "ct129: probe 1 min 42 s | ct200: restart 1 min 42 s"]


def test_counts_read_in_the_singular_where_there_is_one(cli: Cli, capsys: pytest.CaptureFixture[str]) -> None:
    one = DriftReport(host="ct200", baseline="s1", clean=False, checked=1,
                      files=[DriftEntry(path="sglang/x.py", kind="modified")])
    diff._render(FleetReport[DriftReport](command="diff", hosts=[HostRow(host="ct200", result=one)]))
    assert "1 file drifted" in capsys.readouterr().out


def test_a_lock_reads_as_a_time_and_its_age_not_epoch_seconds(
        cli: Cli, make_host: Callable[..., SandboxHost], tmp_path: Path) -> None:
    host = make_host("ct129")
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"ct129": host.inventory_entry(transport="local")}}))
    inv = load_inventory(str(inventory))
    LocalTransport(inv.hosts["ct129"], owner="alice").call("lock", {"owner": "alice@ws1 pid 1 (push)"})
    out = cli("status", "--json", inventory=inventory)
    assert out.exit_code == 3
    notes = out.rows()["ct129"]["result"]["notes"]
    assert any(re.fullmatch(r"locked since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(\d+ s ago\)", n) for n in notes), notes


@pytest.mark.parametrize("as_json", [True, False])
def test_ctrl_c_while_the_inventory_is_read_exits_130_and_says_so(tmp_path: Path, as_json: bool) -> None:
    """Ctrl-C while the inventory is still being read (a FIFO nobody writes: `open` blocks) is an
    interruption: exit 130 with the envelope under --json or a line on stderr, not Typer's silent 130."""
    fifo = tmp_path / "inventory.yaml"
    os.mkfifo(fifo)
    argv = [sys.executable, "-m", "ddtree_deploy.cli", "status", "--inventory", str(fifo), *(["--json"] if as_json else [])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{proc.pid}/wchan").read_text() != "wait_for_partner" and time.monotonic() < deadline:
        time.sleep(0.05)  # wait until it blocks opening the inventory
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, (stdout, stderr)
    if as_json:
        assert json.loads(stdout)["error"]["code"] == "interrupted"
    else:
        assert "interrupted (Ctrl-C)" in stderr and "ddtree-deploy status" in stderr
