"""Over real sshd: a playbook of one's own without `preflight` (the step that locks the host) cannot change
a host, whether another controller holds its lock or nobody does; the refusal is one line naming the host."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from sshd_fleet import Fleet

from ddtree_deploy.inventory import load_inventory
from ddtree_deploy.transport import transport_for
from tests.push.conftest import package_digest

OVERLAYS = Path(__file__).parents[1] / "store" / "overlays"


def test_a_restore_without_preflight_is_refused_while_another_controller_or_no_one_holds_the_lock(
        fleet_factory: Callable[..., Fleet], tmp_path: Path, cli: Callable[..., Any]) -> None:
    fleet = fleet_factory(profiles=("ct200",))
    inventory = fleet.write_inventory(tmp_path / "inventory.yaml", state_base=tmp_path / "state")
    root = fleet.hosts["ct200"].package_root
    pristine = package_digest(root)
    pushed = cli("push", "--host", "ct200", "--overlay", "mini@0.1.0", "--overlays", str(OVERLAYS), "--json",
                 inventory=inventory)
    assert pushed.exit_code == 0, pushed.stdout
    snapshot = pushed.rows()["ct200"]["result"]["summary"]["snapshot"]
    applied = package_digest(root)
    bare = tmp_path / "bare-restore.yaml"
    bare.write_text(yaml.safe_dump({"name": "bare-restore", "steps": [{"restore": {}}]}))

    inv = load_inventory(str(inventory))
    alice = transport_for(inv.hosts["ct200"], inv.ssh, owner="alice")
    try:
        alice.call("lock", {"owner": "alice@ws1 pid 1 (push)", "ttl_s": 600})
        for holder in ("alice@ws1 pid 1 (push)", None):
            if holder is None:
                alice.call("unlock", {"owner": "alice@ws1 pid 1 (push)"})
            out = cli("play", str(bare), "--host", "ct200", "--to", snapshot, "--json", inventory=inventory)
            step = out.rows()["ct200"]["result"]["steps"][0]
            assert out.exit_code != 0 and step["status"] == "failed", out.stdout
            assert step["code"] == ("locked" if holder else "not_locked"), step
            assert step["message"].startswith("ct200: restore refused") and "\n" not in step["message"], step
            assert (holder or "nobody holds") in step["message"], step
            assert ("unlock" if holder else "preflight") in step["hint"], step
            assert package_digest(root) == applied
    finally:
        alice.close()
    rolled = cli("rollback", "--host", "ct200", "--to", snapshot, "--json", inventory=inventory)  # preflight locks
    assert rolled.exit_code == 0, rolled.stdout
    assert package_digest(root) == pristine
