"""A push whose controller dies over SSH once the journal is written: the helper, left running by sshd,
finishes the apply on its own while the server keeps its old argv. The host must then say the overlay
is applied but unverified, and a push of it must restart and probe it (against answers recorded from
the server that still runs the code from before the apply), not call it "already applied"."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sshd_fleet import Fleet

from sandbox.fleet import STANDIN, free_port, host_entry
from tests.push.conftest import package_digest


def test_a_push_killed_over_ssh_after_the_journal_is_unverified_until_pushed_again(
        fleet_factory: Callable[..., Fleet], tmp_path: Path, cli: Callable[..., Any]) -> None:
    fleet = fleet_factory(profiles=("ct200",))
    host = fleet.hosts["ct200"]
    entry = host_entry(host, free_port())
    del entry["transport"]  # the generated entry's ssh alias reaches it
    inventory = fleet.write_inventory(tmp_path / "inventory.yaml", hosts={"ct200": entry})
    paused = tmp_path / "paused"
    pausing = fleet.write_inventory(tmp_path / "pausing.yaml", hosts={"ct200": {**entry, "env": {
        **entry["env"], "DDTREE_TEST_PAUSE_AT": "journal_written", "DDTREE_TEST_PAUSE_SIGNAL": str(paused),
        "DDTREE_TEST_PAUSE_S": "2"}}})
    env = {**os.environ, "DDTREE_AUDIT_LOG": str(tmp_path / "audit.jsonl")}
    subprocess.run([str(host.python), str(STANDIN), "--standin-compile-only", "--package-root",
                    str(host.package_root)], check=True, capture_output=True, env={**env, "HOME": str(host.home)})
    try:
        assert cli("restart", "--host", "ct200", "--json", inventory=inventory).exit_code == 0
        pristine = package_digest(host.package_root)
        proc = subprocess.Popen(["python3", "-m", "ddtree_deploy.cli", "push", "--host", "ct200", "--overlay",
                                 "ddtree@0.1.0", "--inventory", str(pausing)], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not paused.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the push never reached its apply"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the controller; sshd's helper is not in its group
        proc.wait()
        applied = _wait_for_the_helper_to_finish(cli, inventory)
        assert package_digest(host.package_root) != pristine

        assert cli("unlock", "--host", "ct200", "--force", "--json", inventory=inventory).exit_code == 0
        status = cli("status", "--host", "ct200", "--json", inventory=inventory)
        row = status.rows()["ct200"]["result"]
        assert status.exit_code == 3 and row["verified"] is False and row["server"].startswith("healthy"), row
        assert applied.launch is None or "DDTREE" not in " ".join(applied.launch.argv)  # the old argv

        pushed = cli("push", "--host", "ct200", "--overlay", "ddtree@0.1.0", "--json", inventory=inventory)
        result = pushed.rows()["ct200"]["result"]
        steps = {s["step"]: s for s in result["steps"]}
        assert pushed.exit_code == 0 and result["outcome"] == "ok", result
        assert steps["reference"]["status"] == "ok"  # the server still ran the code from before the apply
        assert [steps[s]["status"] for s in ("snapshot", "apply", "restart", "probe")] == ["noop", "noop", "ok", "ok"]
        lossless = [p for p in result["summary"]["probes"] if p["kind"] == "lossless"]
        assert lossless and all(p["status"] == "pass" for p in lossless), lossless
        assert cli("status", "--host", "ct200", "--json", inventory=inventory).exit_code == 0
        assert cli("rollback", "--host", "ct200", "--json", inventory=inventory).exit_code == 0
        assert package_digest(host.package_root) == pristine
    finally:
        cli("stop", "--host", "ct200", "--json", inventory=inventory)


def _wait_for_the_helper_to_finish(cli: Callable[..., Any], inventory: Path) -> Any:
    """The host's state once the orphaned helper closed the journal (it pauses 2 s, then applies)."""
    from ddtree_deploy.inventory import load_inventory
    from ddtree_deploy.remote import locks
    from ddtree_deploy.transport import transport_for

    inv = load_inventory(str(inventory))
    t = transport_for(inv.hosts["ct200"], inv.ssh, "tests")
    try:
        deadline = time.monotonic() + 60
        while True:
            state = locks.state(t)
            if state.journal is None and state.deployed is not None and state.deployed.overlay:
                return state
            assert time.monotonic() < deadline, "the helper never finished the apply"
            time.sleep(0.2)
    finally:
        t.close()
