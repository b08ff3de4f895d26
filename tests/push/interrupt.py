"""Ctrl-C in the middle of a push, as a terminal sends it, and what must hold afterwards (shared by the
sandbox test and the sshd one).

The `slow` overlay (tests/push/overlays) makes the stand-in server take 3 s to start: once the
restart step has started it, the push is mid-step. SIGINT then goes to the CLI's whole process
group, as a terminal's Ctrl-C does, so local host helpers and OpenSSH clients get it too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SLOW_START_ARG = "--standin-start-delay"  # the `slow` overlay's server argument


def push_interrupted(env: dict[str, str], host: str, state_dir: Path, *args: str) -> dict[str, Any]:
    """`push --host HOST --overlay slow --json` (plus `args`), Ctrl-C once its restart step waits for the
    server; checks exit 130 and an empty stderr and returns the `data` of the envelope."""
    proc = subprocess.Popen([sys.executable, "-m", "ddtree_deploy.cli", "push", "--host", host, "--overlay", "slow",
                             "--json", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for_slow_server(state_dir, proc)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stdout + stderr
    assert stderr == ""
    data: dict[str, Any] = json.loads(stdout)["data"]
    return data


def assert_rolled_back_after_the_step(data: dict[str, Any], audit_log: Path) -> None:
    """The step under way finished, the next one did not run, on_failure restored, the audit line says so."""
    assert data["interrupted"] is True
    (row,) = data["hosts"]
    result = row["result"]
    assert (result["outcome"], result["failed_step"], result["reason"]) == ("rolled_back", "probe",
                                                                            "interrupted (Ctrl-C)")
    assert [(s["step"], s["status"]) for s in result["steps"]][-2:] == [("restart", "ok"), ("probe", "failed")]
    assert [s["status"] for s in result["recovery"]] == ["ok", "ok", "ok"] and result["healthy"] is True
    audit = json.loads(audit_log.read_text().splitlines()[-1])
    assert audit["command"] == "push" and audit["hosts"] == {row["host"]: "rolled_back"}
    assert audit["interrupted"] is True


def wait_for_slow_server(state_dir: Path, proc: subprocess.Popen[str]) -> None:
    """Until the restart step has started the slow server (it then waits for it to be ready)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for record in state_dir.glob("*/server/server.json"):
            if SLOW_START_ARG in record.read_text():
                return
        if proc.poll() is not None:
            pytest.fail(f"the push ended before its restart step: {proc.communicate()}")
        time.sleep(0.05)
    pytest.fail("the slow server never started")
