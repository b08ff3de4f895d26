"""What the host's records say on a sandbox host, and what rollback does with them: a push killed after its
apply leaves an overlay marked unverified (status flags it, a push of it restarts and probes, rollback undoes
it); rollback refuses an unknown snapshot and a missing selection before touching anything, and leaves a
host with nothing deployed, server included, alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from interrupt import wait_for_slow_server

if TYPE_CHECKING:
    from conftest import Fleet


def host_row(envelope: dict[str, Any]) -> dict[str, Any]:
    (row,) = envelope["data"]["hosts"]
    result: dict[str, Any] = row["result"]
    assert result is not None, row
    return result


def steps_of(result: dict[str, Any]) -> dict[str, str]:
    return {s["step"]: s["status"] for s in result["steps"]}


def state_dir(fleet: Fleet) -> Path:
    return Path(str(fleet.host_spec()["state_dir"]))


def server_pid(fleet: Fleet) -> int:
    (record,) = state_dir(fleet).glob("*/server/server.json")
    pid: int = json.loads(record.read_text())["pid"]
    return pid


def status_when_served(fleet: Fleet) -> tuple[int, dict[str, Any]]:
    """`status` once the server answers healthy (a server started by a killed push comes up on its own)."""
    deadline = time.monotonic() + 60
    while True:
        code, out = fleet.json("status", "--host", "ct200")
        row = host_row(out)
        if row["server"].startswith("healthy") or time.monotonic() > deadline:
            return code, row
        time.sleep(0.3)


def kill_push_once_its_restart_began(fleet: Fleet) -> None:
    """`push --overlay slow`, SIGKILLed (controller and helper) while the restart waits for the slow server."""
    proc = subprocess.Popen([sys.executable, "-m", "ddtree_deploy.cli", "push", "--host", "ct200", "--overlay", "slow"],
                            env=fleet.env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for_slow_server(state_dir(fleet), proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("then", ["push again", "rollback"])
def test_a_push_killed_after_its_apply_is_unverified_until_pushed_again_or_rolled_back(
        fleet: Fleet, then: str) -> None:
    assert fleet.json("rollback", "--host", "ct200")[0] == 0
    pristine = fleet.package_digest()
    kill_push_once_its_restart_began(fleet)
    assert fleet.json("unlock", "--host", "ct200", "--force")[0] == 0  # as after the lock's expiry
    code, row = status_when_served(fleet)
    assert code == 3 and row["needs_attention"] and row["overlay"] == "slow@0.0.1" and row["verified"] is False, row
    assert any("never verified" in note and "push it again" in note for note in row["notes"]), row["notes"]

    if then == "rollback":
        code, out = fleet.json("rollback", "--host", "ct200")
        assert code == 0 and host_row(out)["outcome"] == "ok", out
        assert fleet.package_digest() == pristine
    else:
        applied = fleet.package_digest()
        code, out = fleet.json("push", "--host", "ct200", "--overlay", "slow")
        result = host_row(out)
        assert code == 0 and result["outcome"] == "ok", result
        assert steps_of(result) == {"preflight": "ok", "plan": "ok", "reference": "noop", "snapshot": "noop",
                                    "apply": "noop", "restart": "ok", "probe": "ok"}, result
        messages = {s["step"]: s["message"] for s in result["steps"]}
        assert "never verified" in messages["plan"] and "recorded as verified" in messages["probe"]
        assert "started after the overlay was applied" in messages["reference"]  # no reference from itself
        assert fleet.package_digest() == applied
        code, out = fleet.json("push", "--host", "ct200", "--overlay", "slow")
        assert code == 0 and host_row(out)["outcome"] == "noop"
        assert fleet.json("rollback", "--host", "ct200")[0] == 0
    code, row = status_when_served(fleet)
    assert code == 0 and row["notes"] == [], row


def test_rollback_with_nothing_deployed_leaves_the_server_alone(fleet: Fleet) -> None:
    assert fleet.json("push", "--host", "ct200", "--overlay", "ddtree@0.1.0")[0] == 0
    assert fleet.json("rollback", "--host", "ct200")[0] == 0  # the host's record now names the pristine snapshot
    pid = server_pid(fleet)
    code, out = fleet.json("rollback", "--host", "ct200")
    result = host_row(out)
    assert code == 0 and steps_of(result) == {"preflight": "ok", "restore": "noop", "restart": "noop",
                                              "probe": "noop"}, result
    assert server_pid(fleet) == pid
    assert fleet.json("status", "--host", "ct200")[0] == 0


def test_rollback_to_an_unknown_snapshot_is_bad_input_and_touches_nothing(fleet: Fleet) -> None:
    assert fleet.json("push", "--host", "ct200", "--overlay", "ddtree@0.1.0")[0] == 0
    applied, pid = fleet.package_digest(), server_pid(fleet)
    code, out = fleet.json("snapshots", "--host", "ct200")
    newest = host_row(out)["snapshots"][-1]["id"]
    code, out = fleet.json("rollback", "--host", "ct200", "--to", "20990101T000000Z-00000000")
    result = host_row(out)
    failed = next(s for s in result["steps"] if s["status"] == "failed")
    assert code == 2 and result["outcome"] == "refused", result
    assert failed["step"] == "restore" and failed["code"] == "unknown_snapshot" and failed["bad_input"]
    assert "ct200" in failed["message"] and "20990101T000000Z-00000000" in failed["message"]
    assert newest in failed["hint"]
    assert fleet.package_digest() == applied and server_pid(fleet) == pid
    assert fleet.json("rollback", "--host", "ct200")[0] == 0


def test_rollback_without_a_host_selection_is_bad_input(fleet: Fleet) -> None:
    before = fleet.package_digest()
    proc = fleet.cli("rollback")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--host" in proc.stderr and fleet.package_digest() == before
