"""A damaged state.json or journal.json (a disk that filled mid-write, a hand edit) is named, and the store
stays the truth: `rollback --to SNAPSHOT` restores bit-exact and rewrites a good state.

Before, the helper crashed on the JSON ("report this with the traceback"), `status` called the host
unreachable and no rollback worked.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from store_helpers import (
    OVERLAYS,
    LocalHost,
    corrupt_object,
    folder_listing,
    local_transport,
    make_ctx,
    only_result,
    push_in_process,
    run_and_kill,
    tree_state,
)

from ddtree_deploy.hostside import drift, locks, store
from ddtree_deploy.hostside.common import Context, HelperFailure
from ddtree_deploy.output import ExitCode
from ddtree_deploy.overlay import Overlay
from ddtree_deploy.remote import locks as remote_locks
from ddtree_deploy.remote import transactions as remote_transactions

Cli = Callable[..., Any]
SERVER_ARGS = "sglang/srt/server_args.py"
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
    damaged = Path(remote_locks.state(sandbox_host.transport).state_dir) / name
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
    state = remote_locks.state(sandbox_host.transport)
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


def journal_files(ctx: Context) -> dict[str, bytes]:
    """journal.json and every copy of it kept beside it, by name."""
    return {p.name: p.read_bytes() for p in sorted(Path(ctx.state_dir).glob("journal.json*"))}


def test_a_failed_rollback_to_a_snapshot_leaves_a_damaged_journal_as_it_was(
        cli: Cli, inventory: Path, ctx: Context, site: Path, mini: Callable[[str], Overlay]) -> None:
    """The restore stops in staging (a stored byte went bad): the damaged bytes are back in journal.json, not a
    made-up journal, so status still names the damage and `rollback --to` still undoes the push."""
    def run(*args: str) -> Any:
        return cli(*args, "--host", "sbx", "--json", inventory=inventory)

    pristine = tree_state(site)
    _, snap = push_in_process(ctx, mini("0.1.0"))
    applied = tree_state(site)
    Path(ctx.path("journal.json")).write_bytes(DAMAGED["journal.json"])
    bad = json.loads(Path(ctx.path("snapshots", snap + ".json")).read_text())["files"][SERVER_ARGS]["sha256"]
    corrupt_object(ctx, bad)
    locks.unlock(ctx, {"owner": "tests"})  # the in-process push is over: the CLI's rollback takes the lock
    listing = folder_listing(Path(ctx.state_dir))

    failed = run("rollback", "--to", snap)
    step = next(s for s in only_result(failed)["steps"] if s["status"] == "failed")
    assert failed.exit_code != 0 and step["code"] == "object_corrupt", failed.stdout
    assert tree_state(site) == applied and folder_listing(Path(ctx.state_dir)) == listing
    assert journal_files(ctx) == {"journal.json": DAMAGED["journal.json"]}
    state = locks.state(ctx, {})
    assert state["journal"] is None and [d["file"] for d in state["damaged"]] == ["journal.json"]
    row = only_result(run("status"))
    assert row["damaged"] == [ctx.path("journal.json")] and not row["journal_open"], row
    assert any("--to SNAPSHOT" in note for note in row["notes"]), row["notes"]

    corrupt_object(ctx, bad)  # the store repaired: the same rollback now finishes and clears the damage
    restored = run("rollback", "--to", snap)
    assert restored.exit_code == 0 and only_result(restored)["outcome"] == "ok", restored.stdout
    assert tree_state(site) == pristine and journal_files(ctx) == {}
    state = locks.state(ctx, {})
    assert state["damaged"] == [] and state["journal"] is None
    closed = state["history"][-1]
    assert closed["op"] == "restore" and closed["damaged_journal"]["error"].startswith("not valid JSON"), closed


def test_a_rollback_killed_over_a_damaged_journal_keeps_its_bytes_until_a_rollback_finishes(
        cli: Cli, inventory: Path, ctx: Context, site: Path, tmp_path: Path, mini: Callable[[str], Overlay]) -> None:
    """Killed after its first file: the open journal is the restore's own (what a rollback must finish) and names
    the copy of the damaged bytes beside it; status says both; the next plain rollback finishes and removes it."""
    pristine = tree_state(site)
    _, snap = push_in_process(ctx, mini("0.1.0"))
    Path(ctx.path("journal.json")).write_bytes(DAMAGED["journal.json"])
    t = local_transport(site, tmp_path / "state")
    run_and_kill(lambda: remote_transactions.restore(t, snap), "restore_file_written:1", tmp_path)

    journal = locks.state(ctx, {})["journal"]
    assert journal["op"] == "restore" and journal["snapshot"] == snap and journal["interrupted"] is None, journal
    kept = journal["damaged"]
    assert kept["file"] == "journal.json" and kept["error"].startswith("not valid JSON"), kept
    assert journal_files(ctx)[Path(kept["path"]).name] == DAMAGED["journal.json"]
    assert Path(kept["path"]).parent == Path(ctx.state_dir) and Path(kept["path"]).name != "journal.json"
    row = only_result(cli("status", "--host", "sbx", "--json", inventory=inventory))
    assert row["journal_open"] and any(kept["path"] in note for note in row["notes"]), row["notes"]

    result = remote_transactions.restore(t)
    assert result.snapshot == snap and result.closed_journal
    assert tree_state(site) == pristine and journal_files(ctx) == {}
    assert locks.state(ctx, {})["journal"] is None
