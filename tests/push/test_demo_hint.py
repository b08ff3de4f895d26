"""The demo's closing hint is true: its env file, sourced in a shell, runs `ddtree-deploy status` on the fleet."""

from __future__ import annotations

import json
import subprocess
from typing import TYPE_CHECKING

from sandbox.demo import write_env_file

if TYPE_CHECKING:
    from conftest import Fleet


def test_the_demos_env_file_gives_a_shell_the_fleet_and_a_ddtree_deploy(fleet: Fleet) -> None:
    env_file = write_env_file(fleet.root)
    # only what a user's shell has (no inventory, no PYTHONPATH beyond the checkout the tests run)
    env = {"PATH": "/usr/bin:/bin", "HOME": fleet.env["HOME"], "PYTHONPATH": fleet.env["PYTHONPATH"]}
    shell = subprocess.run(["bash", "-c", f". {env_file} && ddtree-deploy status --json"], env=env,
                           capture_output=True, text=True, check=False)
    assert (shell.returncode, shell.stderr) == (0, ""), shell.stdout
    rows = json.loads(shell.stdout)["data"]["hosts"]
    assert [(r["host"], r["result"]["server"].split()[0]) for r in rows] == [("ct200", "healthy")]
