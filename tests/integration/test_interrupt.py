"""Ctrl-C during a push over real SSH: the host stops at its next safe point, rolls back, and the report,
the audit line and exit 130 follow; the package ends bit-exact.

Over the paramiko connection every command opens (the case that used to run to the end and print
nothing). The push itself is tests/push/interrupt.py's.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from sshd_fleet import Fleet

from sandbox.fleet import STANDIN, free_port, host_entry
from tests.push.conftest import package_digest
from tests.push.interrupt import assert_rolled_back_after_the_step, push_interrupted

SLOW = Path(__file__).resolve().parents[1] / "push" / "overlays" / "slow"


def test_ctrl_c_over_ssh_rolls_back_reports_audits_and_exits_130(
        fleet_factory: Callable[..., Fleet], tmp_path: Path) -> None:
    fleet = fleet_factory(profiles=("ct200",))
    host = fleet.hosts["ct200"]
    entry = host_entry(host, free_port())
    del entry["transport"]  # the generated entry's ssh alias reaches it
    inventory = fleet.write_inventory(tmp_path / "inventory.yaml", hosts={"ct200": entry})
    (tmp_path / "overlays").mkdir()
    (tmp_path / "overlays" / "slow").symlink_to(SLOW)
    env = {**os.environ, "DDTREE_INVENTORY": str(inventory), "DDTREE_OVERLAYS": str(tmp_path / "overlays"),
           "DDTREE_AUDIT_LOG": str(tmp_path / "audit.jsonl")}
    # The stand-in compiles the package once per cache (under the host's HOME, as sshd sets it).
    subprocess.run([str(host.python), str(STANDIN), "--standin-compile-only", "--package-root",
                    str(host.package_root)], check=True, capture_output=True, env={**env, "HOME": str(host.home)})
    started = subprocess.run(["python3", "-m", "ddtree_deploy.cli", "restart", "--host", "ct200"], env=env,
                             capture_output=True, text=True, check=False)
    assert started.returncode == 0, started.stdout + started.stderr
    before = package_digest(host.package_root)
    try:
        data = push_interrupted(env, "ct200", host.state_dir)
        assert_rolled_back_after_the_step(data, tmp_path / "audit.jsonl")
        assert package_digest(host.package_root) == before
    finally:
        subprocess.run(["python3", "-m", "ddtree_deploy.cli", "stop", "--host", "ct200"], env=env,
                       capture_output=True, check=False)

