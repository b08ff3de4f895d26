"""A damaged state.json or journal.json (a disk that filled mid-write, a hand edit) is named, and the store
stays the truth: `rollback --to SNAPSHOT` restores bit-exact and rewrites a good state.

Before, the helper crashed on the JSON ("report this with the traceback"), `status` called the host
unreachable and no rollback worked.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from store_helpers import OVERLAYS, LocalHost, make_ctx, only_result, tree_state

from ddtree_deploy.hostside import drift, store
from ddtree_deploy.hostside.common import HelperFailure
from ddtree_deploy.output import ExitCode
from ddtree_deploy.remote import locks

Cli = Callable[..., Any]
DAMAGED = {"state.json": b'{"overlay": "mini", "version": "0.1', "journal.json": b'{"op": "apply", "snap'}


@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_a_damaged_state_file_is_named_and_rollback_to_a_snapshot_restores_anyway(
        cli: Cli, sandbox_host: LocalHost, name: str) -> None:
    def run(*args: str) -> Any:
        return cli(*args, "--host", "sbx", "--json", inventory=sandbox_host.inventory)

    pristine = tree_state(sandbox_host.site)
    pushed = run("push", "--overlay", "mini@0.1.0", "--overlays", str(OVERLAYS))
    assert pushed.exit_code == 0, pushed.stdout
    snapshot = only_result(pushed)["summary"]["snapshot"]
    damaged = Path(locks.state(sandbox_host.transport).state_dir) / name
    damaged.write_bytes(DAMAGED[name])
    applied = tree_state(sandbox_host.site)

    status = run("status")
    row = only_result(status)
    assert status.exit_code == ExitCode.HOST_NEEDS_ATTENTION and row["needs_attention"], row
    assert row["damaged"] == [str(damaged)] and row["sglang"] == "0.5.17"
    assert any(str(damaged) in note and "--to SNAPSHOT" in note for note in row["notes"]), row["notes"]

    for refused in (run("push", "--overlay", "mini@0.2.0", "--overlays", str(OVERLAYS)), run("rollback")):
        failed = next(s for s in only_result(refused)["steps"] if s["status"] == "failed")
        assert refused.exit_code == ExitCode.HOST_NEEDS_ATTENTION, refused.stdout
        assert failed["code"] == "state_damaged" and str(damaged) in failed["message"], failed
        assert "--to SNAPSHOT" in failed["hint"] and snapshot in failed["hint"], failed
        assert tree_state(sandbox_host.site) == applied and damaged.read_bytes() == DAMAGED[name]

    restored = run("rollback", "--to", snapshot)
    assert restored.exit_code == 0 and only_result(restored)["outcome"] == "ok", restored.stdout
    assert tree_state(sandbox_host.site) == pristine
    state = locks.state(sandbox_host.transport)
    assert state.damaged == [] and state.journal is None and state.deployed is not None
    assert run("status").exit_code == 0


@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_ops_that_need_a_damaged_record_refuse_naming_it(site: Path, tmp_path: Path, name: str) -> None:
    ctx = make_ctx(site, tmp_path / "state")
    taken = store.snapshot(ctx, {"reason": "r"})["id"]
    with open(ctx.path(name), "wb") as f:
        f.write(DAMAGED[name])
    for op in (store.snapshot, store.prune, drift.verify):
        with pytest.raises(HelperFailure) as err:
            op(ctx, {"reason": "r", "keep": 1})
        assert err.value.code == "state_damaged" and ctx.path(name) in err.value.message, op
    assert store.snapshots(ctx, {})["snapshots"][0]["id"] == taken  # the listing `rollback --to` needs still works
