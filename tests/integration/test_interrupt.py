"""Ctrl-C during a push over real SSH: the host stops at its next safe point, rolls back, and the report,
the audit line and exit 130 follow; the package ends bit-exact.

Over a fresh paramiko connection (the case that used to run to the end and print nothing), and
through a warm OpenSSH control master, whose `ssh` client sits in the CLI's process group and so
gets the terminal's SIGINT too. The push itself is tests/push/interrupt.py's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sshd_fleet import Fleet

from ddtree_deploy.transport import _listening
from sandbox.fleet import STANDIN, free_port, host_entry
from tests.push.conftest import package_digest
from tests.push.interrupt import assert_rolled_back_after_the_step, push_interrupted

SLOW = Path(__file__).resolve().parents[1] / "push" / "overlays" / "slow"


@pytest.fixture
def runtime() -> Iterator[Path]:
    """This test's own runtime folder (its control masters live there), short enough for a socket path."""
    folder = Path(tempfile.mkdtemp(prefix="int-"))
    try:
        yield folder
    finally:
        for sock in (folder / "ddtree-deploy" / "ssh").glob("cm-*"):
            subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "unused"], capture_output=True,
                           check=False)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("control_persist_s", [0, 30], ids=["paramiko", "control-master"])
def test_ctrl_c_over_ssh_rolls_back_reports_audits_and_exits_130(
        fleet_factory: Callable[..., Fleet], tmp_path: Path, runtime: Path, control_persist_s: int) -> None:
    fleet = fleet_factory(profiles=("ct200",))
    host = fleet.hosts["ct200"]
    entry = host_entry(host, free_port())
    del entry["transport"]  # the generated entry's ssh alias reaches it
    inventory = fleet.write_inventory(tmp_path / "inventory.yaml", hosts={"ct200": entry},
                                      ssh={"control_persist_s": control_persist_s})
    (tmp_path / "overlays").mkdir()
    (tmp_path / "overlays" / "slow").symlink_to(SLOW)
    env = {**os.environ, "DDTREE_INVENTORY": str(inventory), "DDTREE_OVERLAYS": str(tmp_path / "overlays"),
           "DDTREE_AUDIT_LOG": str(tmp_path / "audit.jsonl"), "XDG_RUNTIME_DIR": str(runtime),
           "DDTREE_DEPLOY_FORKSERVER": "0"}
    # The stand-in compiles the package once per cache (under the host's HOME, as sshd sets it).
    subprocess.run([str(host.python), str(STANDIN), "--standin-compile-only", "--package-root",
                    str(host.package_root)], check=True, capture_output=True, env={**env, "HOME": str(host.home)})
    started = subprocess.run(["python3", "-m", "ddtree_deploy.cli", "restart", "--host", "ct200"], env=env,
                             capture_output=True, text=True, check=False)
    assert started.returncode == 0, started.stdout + started.stderr
    if control_persist_s:
        _wait_for_master(runtime)
    before = package_digest(host.package_root)
    try:
        data = push_interrupted(env, "ct200", host.state_dir)
        assert_rolled_back_after_the_step(data, tmp_path / "audit.jsonl")
        assert package_digest(host.package_root) == before
    finally:
        subprocess.run(["python3", "-m", "ddtree_deploy.cli", "stop", "--host", "ct200"], env=env,
                       capture_output=True, check=False)


def _wait_for_master(runtime: Path) -> None:
    """The master that `restart` left (it starts detached), so the push's sessions go through it."""
    deadline = time.monotonic() + 20
    while not any(_listening(str(p)) for p in (runtime / "ddtree-deploy" / "ssh").glob("cm-*")):
        if time.monotonic() > deadline:
            pytest.fail("no control master came up")
        time.sleep(0.05)
