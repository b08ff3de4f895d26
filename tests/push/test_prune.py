"""`ddtree-deploy prune` on a sandbox host: old snapshots go, rollback still undoes the deployed overlay."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conftest import Fleet


def only_row(envelope: dict[str, Any]) -> dict[str, Any]:
    rows = envelope["data"]["hosts"]
    assert len(rows) == 1
    return rows[0]


def snapshot_ids(fleet: Fleet) -> list[str]:
    code, out = fleet.json("snapshots", "--host", "ct200")
    assert code == 0
    return [s["id"] for s in only_row(out)["result"]["snapshots"]]


def test_prune_keeps_what_rollback_needs_and_a_dry_run_changes_nothing(fleet: Fleet) -> None:
    pristine = fleet.package_digest()
    # 0.2.0 deployed, a failed push on top of it (its snapshot holds 0.2.0's files), back to pristine,
    # then 0.1.0 deployed: the first two snapshots are old, and only they hold 0.2.0's contents.
    for args in (("push", "--overlay", "ddtree@0.2.0"), ("push", "--overlay", "lossy"), ("rollback",),
                 ("rollback",), ("push", "--overlay", "ddtree@0.1.0")):
        fleet.json(*args[:1], "--host", "ct200", *args[1:])
    deployed = fleet.package_digest()
    before = snapshot_ids(fleet)
    assert len(before) >= 3 and deployed != pristine

    code, out = fleet.json("prune", "--host", "ct200", "--keep", "1", "--dry-run")
    result = only_row(out)["result"]
    assert code == 0 and result["outcome"] == "dry_run", result
    assert snapshot_ids(fleet) == before and result["summary"]["pruned"]["removed"]

    code, out = fleet.json("prune", "--host", "ct200", "--keep", "1")
    result = only_row(out)["result"]
    assert code == 0 and result["outcome"] == "ok", result
    pruned = result["summary"]["pruned"]
    assert snapshot_ids(fleet) == pruned["kept"] and set(pruned["removed"]) == set(before) - set(pruned["kept"])
    assert pruned["objects_removed"] > 0 and fleet.package_digest() == deployed  # the package is untouched

    code, out = fleet.json("rollback", "--host", "ct200")
    assert code == 0 and only_row(out)["result"]["outcome"] == "ok"
    assert fleet.package_digest() == pristine  # rollback still undoes the deployed overlay, bit-exact


def test_prune_without_a_host_selection_is_bad_input(fleet: Fleet) -> None:
    proc = fleet.cli("prune")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--host" in proc.stdout + proc.stderr
