"""Host-side store ops, called in-process on a copy of the real sglang 0.5.17 package."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from store_helpers import (
    folder_listing,
    object_count,
    pip_listing,
    plan_in_process,
    push_in_process,
    stored_objects,
    tree_state,
)

from ddtree_deploy.hostside import drift, objects, package, store, transactions
from ddtree_deploy.hostside.common import Context, HelperFailure, read_json
from ddtree_deploy.overlay import Overlay

SERVER_ARGS = "sglang/srt/server_args.py"
SPEC_INFO = "sglang/srt/speculative/spec_info.py"
MINI_UTILS = "sglang/srt/speculative/mini_utils.py"
PIP_RECORD = "sglang-0.5.17.dist-info/RECORD"
MINI_V2 = "sglang/srt/speculative/mini_v2.py"


def count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every file the helper reads to hash it (a snapshot's scan reads through its Collector)."""
    calls: list[str] = []
    real_hash, real_collect = objects.hash_file, objects.Collector.hash

    def counting(path: str) -> str:
        calls.append(path)
        return real_hash(path)

    def collecting(self: objects.Collector, path: str, st: os.stat_result) -> str:
        calls.append(path)
        return real_collect(self, path, st)

    for module in (package, transactions):
        monkeypatch.setattr(module, "hash_file", counting)
    monkeypatch.setattr(objects.Collector, "hash", collecting)
    return calls


def manifest_of(ctx: Context, snap_id: str) -> dict[str, Any]:
    return json.loads(Path(ctx.path("snapshots", snap_id + ".json")).read_text())


def test_first_snapshot_stores_the_whole_release_and_later_ones_read_only_what_changed(
        full_ctx: Context, full_site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = store.snapshot(full_ctx, {"reason": "first", "fingerprint": {"torch": "2.11.0"}})
    manifest = json.loads(Path(full_ctx.path("snapshots", first["id"] + ".json")).read_text())
    expected = tree_state(full_site)
    assert {p: (e["sha256"], e["mode"]) for p, e in manifest["files"].items()} == {
        p: v for p, v in expected.items() if not p.endswith("/")}
    assert first["files"] == len(manifest["files"]) > 3000 and "sglang-0.5.17.dist-info/RECORD" in manifest["files"]
    assert not [p for p in manifest["files"] if "__pycache__" in p]
    assert manifest["fingerprint"] == {"torch": "2.11.0"} and manifest["reason"] == "first"
    distinct = {e["sha256"] for e in manifest["files"].values()}
    assert first["new_objects"] == len(distinct) and first["new_bytes"] > 50_000_000
    (pack, packed), = stored_objects(full_ctx).items()  # one pack and no loose object
    assert pack.endswith(".pack") and set(packed) == distinct
    entry = manifest["files"][SERVER_ARGS]
    content = objects.ObjectStore(full_ctx).read(entry["sha256"])
    assert content == (full_site / SERVER_ARGS).read_bytes() and entry["size"] == len(content)

    hashed = count_hashing(monkeypatch)
    second = store.snapshot(full_ctx, {"reason": "second"})
    assert hashed == [] and second["new_objects"] == 0 and second["same_as"] == first["id"]
    (full_site / SERVER_ARGS).write_text("changed\n")
    third = store.snapshot(full_ctx, {"reason": "third"})
    assert hashed == [str(full_site / SERVER_ARGS)]
    assert third["new_objects"] == 1 and third["same_as"] is None
    assert stored_objects(full_ctx)["loose"] == [manifest_of(full_ctx, third["id"])["files"][SERVER_ARGS]["sha256"]]


def test_stat_cache_notices_a_same_size_rewrite_with_its_mtime_put_back(ctx: Context, site: Path) -> None:
    store.snapshot(ctx, {"reason": "first"})
    target = site / SPEC_INFO
    before = target.stat()
    data = bytearray(target.read_bytes())
    data[0:1] = b"#" if data[0:1] != b"#" else b"%"
    target.write_bytes(bytes(data))
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same mtime, same inode
    snap = store.snapshot(ctx, {"reason": "second"})
    manifest = read_json(ctx.path("snapshots", snap["id"] + ".json"))
    assert snap["new_objects"] == 1
    assert manifest["files"][SPEC_INFO]["sha256"] == objects.hash_file(str(target))


def test_push_then_restore_is_bit_exact_and_pushing_twice_writes_nothing(
        full_ctx: Context, full_site: Path, mini: Callable[[str], Overlay]) -> None:
    ctx, site = full_ctx, full_site
    pristine = tree_state(site)
    the_plan, snap = push_in_process(ctx, mini("0.1.0"))
    assert {c.path: c.action for c in the_plan.changes} == {
        SERVER_ARGS: "write", SPEC_INFO: "write", MINI_UTILS: "create", PIP_RECORD: "write"}
    listed, wrong = pip_listing(site)  # `pip uninstall sglang` would remove the created file too
    assert MINI_UTILS in listed and not wrong, wrong
    assert b"MINI_OVERLAY = True" in (site / SERVER_ARGS).read_bytes()
    assert (site / MINI_UTILS).read_bytes() == (mini("0.1.0").root / "files" / MINI_UTILS).read_bytes()
    assert drift.verify(ctx, {})["clean"]
    state = read_json(ctx.path("state.json"))
    assert (state["overlay"], state["version"], state["snapshot"]) == ("mini", "0.1.0", snap)

    deployed_tree, state_files = tree_state(site), folder_listing(Path(ctx.state_dir))
    again = plan_in_process(ctx, mini("0.1.0"))
    assert again.noop and again.digest == the_plan.digest and sorted(again.unchanged) == sorted(the_plan.files)
    assert tree_state(site) == deployed_tree and folder_listing(Path(ctx.state_dir)) == state_files

    restored = transactions.restore(ctx, {})
    assert restored["snapshot"] == snap and restored["removed"] == [MINI_UTILS]
    assert tree_state(site) == pristine
    assert read_json(ctx.path("state.json"))["overlay"] is None
    assert not os.path.exists(ctx.path("journal.json"))


def test_upgrade_reverts_what_the_new_version_drops_and_rollback_returns_to_the_old_one(
        ctx: Context, site: Path, mini: Callable[[str], Overlay], layout: str) -> None:
    pristine = tree_state(site)
    _, base_snap = push_in_process(ctx, mini("0.1.0"))
    on_010 = tree_state(site)
    upgrade, pre_upgrade = push_in_process(ctx, mini("0.2.0"))
    actions = {c.path: (c.action, c.why) for c in upgrade.changes}
    assert actions[SERVER_ARGS] == ("write", "revert of the deployed overlay")
    assert actions[MINI_V2][0] == "create" and actions[MINI_UTILS][0] == "write"
    assert SPEC_INFO in upgrade.unchanged  # the same hunk in both versions: nothing to write
    listed, wrong = pip_listing(site)  # RECORD lists what 0.2.0 created, with every hash up to date
    assert {MINI_V2, MINI_UTILS} <= listed and not wrong, wrong
    assert tree_state(site)[SERVER_ARGS] == pristine[SERVER_ARGS]
    assert drift.verify(ctx, {})["clean"]
    assert read_json(ctx.path("state.json"))["base_snapshot"] == base_snap

    transactions.restore(ctx, {})  # default: the snapshot taken before this push
    assert tree_state(site) == on_010
    assert read_json(ctx.path("state.json"))["version"] == "0.1.0" and drift.verify(ctx, {})["clean"]
    transactions.restore(ctx, {"snapshot": base_snap})
    assert tree_state(site) == pristine and pre_upgrade != base_snap
    _, again = push_in_process(ctx, mini("0.1.0"))
    transactions.restore(ctx, {})  # a snapshot without overlay becomes its own base and rollback target
    state = read_json(ctx.path("state.json"))
    assert (state["overlay"], state["snapshot"], state["base_snapshot"]) == (None, again, again)


def test_drift_is_reported_file_by_file(ctx: Context, site: Path, mini: Callable[[str], Overlay]) -> None:
    push_in_process(ctx, mini("0.1.0"))
    (site / "sglang-0.5.17.dist-info/METADATA").write_text("edited by hand\n")
    (site / MINI_UTILS).unlink()
    (site / "sglang/stray.py").write_text("x = 1\n")
    os.chmod(site / "sglang/__init__.py", 0o600)
    report = drift.verify(ctx, {})
    assert not report["clean"]
    assert {d["path"]: d["kind"] for d in report["files"]} == {
        "sglang-0.5.17.dist-info/METADATA": "modified", MINI_UTILS: "missing", "sglang/stray.py": "added",
        "sglang/__init__.py": "mode"}
    # What `status` asks: the overlay's own files only (METADATA, stray.py and __init__.py are not its files)
    own = drift.verify(ctx, {"overlay_only": True})
    assert {d["path"]: d["kind"] for d in own["files"]} == {MINI_UTILS: "missing"}
    assert own["checked"] == len(read_json(ctx.path("state.json"))["files"]) and not own["clean"]
    os.chmod(site / SERVER_ARGS, 0o600)
    assert {d["path"]: d["kind"] for d in drift.verify(ctx, {"overlay_only": True})["files"]} == {
        MINI_UTILS: "missing", SERVER_ARGS: "mode"}


def test_restore_restores_modes_and_removes_new_folders(ctx: Context, site: Path) -> None:
    pristine = tree_state(site)
    snap = store.snapshot(ctx, {"reason": "r"})["id"]
    os.chmod(site / SERVER_ARGS, 0o600)
    os.chmod(site / "sglang/srt", 0o700)
    (site / "sglang/newpkg/deeper").mkdir(parents=True)
    (site / "sglang/newpkg/deeper/x.py").write_text("")
    (site / SPEC_INFO).unlink()
    with pytest.raises(HelperFailure) as err:  # nothing deployed, no journal: the target must be named
        transactions.restore(ctx, {})
    assert err.value.code == "no_snapshot"
    result = transactions.restore(ctx, {"snapshot": snap})
    assert result["restored"] == [SPEC_INFO] and result["removed"] == ["sglang/newpkg/deeper/x.py"]
    assert tree_state(site) == pristine


def test_unknown_snapshot_id_is_refused_naming_known_ones(ctx: Context, site: Path) -> None:
    snap = store.snapshot(ctx, {"reason": "r"})
    before = tree_state(site)
    for bad in ("20990101T000000Z-deadbeef", "../../etc/passwd"):
        with pytest.raises(HelperFailure) as err:
            transactions.restore(ctx, {"snapshot": bad})
        assert err.value.code == "unknown_snapshot"
    assert snap["id"] in err.value.hint or snap["id"] in str(store.snapshots(ctx, {}))
    assert tree_state(site) == before and not os.path.exists(ctx.path("journal.json"))


@pytest.mark.parametrize("path", ["../etc/passwd", "/etc/passwd", "sglang/../../x", "sglang/./x", "other/x.py", ""])
def test_paths_escaping_the_package_are_refused(ctx: Context, path: str) -> None:
    with pytest.raises(HelperFailure) as err:
        store.read_files(ctx, {"paths": [path]})
    assert err.value.code == "path_escapes"


def test_symlinks_leading_outside_the_package_are_refused(ctx: Context, site: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.py").write_text("x")
    (site / "sglang/escape").symlink_to(outside)
    (site / "sglang/leak.py").symlink_to(outside / "secret.py")
    for path in ("sglang/escape/secret.py", "sglang/leak.py"):
        with pytest.raises(HelperFailure) as err:
            store.read_files(ctx, {"paths": [path]})
        assert err.value.code == "path_escapes" and path in err.value.message


def test_apply_refuses_files_changed_since_the_plan_and_changes_nothing(
        ctx: Context, site: Path, mini: Callable[[str], Overlay]) -> None:
    the_plan = plan_in_process(ctx, mini("0.1.0"))
    snap = store.snapshot(ctx, {"reason": "pre-push"})["id"]
    with open(site / SPEC_INFO, "a") as f:
        f.write("# someone else\n")
    before, state_before = tree_state(site), folder_listing(Path(ctx.state_dir))
    with pytest.raises(HelperFailure) as err:
        transactions.apply(ctx, the_plan.helper_args(snap))
    assert err.value.code == "preimage_changed" and SPEC_INFO in err.value.message
    assert tree_state(site) == before and folder_listing(Path(ctx.state_dir)) == state_before


def test_apply_refuses_a_snapshot_that_does_not_record_the_files_now(
        ctx: Context, site: Path, mini: Callable[[str], Overlay]) -> None:
    old = store.snapshot(ctx, {"reason": "old"})["id"]
    with open(site / SPEC_INFO, "a") as f:
        f.write("# local edit after the snapshot\n")
    with pytest.raises(Exception) as err:  # the pristine pre-image no longer matches: the plan refuses first
        plan_in_process(ctx, mini("0.1.0"))
    assert getattr(err.value, "code", None) == "preimage_mismatch"
    (site / SPEC_INFO).write_bytes((site / SPEC_INFO).read_bytes().replace(b"# local edit after the snapshot\n", b""))
    the_plan = plan_in_process(ctx, mini("0.1.0"))
    os.chmod(site / SERVER_ARGS, 0o640)
    store.snapshot(ctx, {"reason": "new"})
    args = the_plan.helper_args(old)
    (site / MINI_UTILS).write_text("")  # a file created after snapshot `old`
    args["changes"] = [dict(c, action="write", expect=objects.hash_file(str(site / MINI_UTILS)))
                       if c["path"] == MINI_UTILS else c for c in args["changes"]]
    with pytest.raises(HelperFailure) as refused:
        transactions.apply(ctx, args)
    assert refused.value.code == "snapshot_stale" and MINI_UTILS in refused.value.message


def test_changes_refuse_while_a_journal_is_open(ctx: Context, site: Path, mini: Callable[[str], Overlay]) -> None:
    the_plan = plan_in_process(ctx, mini("0.1.0"))
    snap = store.snapshot(ctx, {"reason": "pre-push"})["id"]
    Path(ctx.path("journal.json")).write_text(json.dumps({"op": "apply", "snapshot": snap, "paths": []}))
    for op, args in ((store.snapshot, {"reason": "x"}), (transactions.apply, the_plan.helper_args(snap))):
        with pytest.raises(HelperFailure) as err:
            op(ctx, args)
        assert err.value.code == "journal_open" and snap in err.value.hint
    assert drift.verify(ctx, {})["journal"]["snapshot"] == snap
    transactions.restore(ctx, {})
    assert not os.path.exists(ctx.path("journal.json"))


def test_snapshots_lists_id_time_reason_files_overlay(ctx: Context, mini: Callable[[str], Overlay]) -> None:
    _, first = push_in_process(ctx, mini("0.1.0"))
    second = store.snapshot(ctx, {"reason": "manual", "fingerprint": {"torch_version": "2.11.0+cu128"}})
    rows = store.snapshots(ctx, {})["snapshots"]
    assert rows[0]["fingerprint"] is None and rows[1]["fingerprint"] == {"torch_version": "2.11.0+cu128"}
    assert [(r["id"], r["reason"], r["overlay"]) for r in rows] == [
        (first, "pre-push", None), (second["id"], "manual", "mini@0.1.0")]
    assert rows[0]["files"] + 1 == rows[1]["files"] and rows[0]["time"] <= rows[1]["time"]
    Path(ctx.path("snapshots", "index.jsonl")).unlink()  # the manifests alone still answer
    assert [r["id"] for r in store.snapshots(ctx, {})["snapshots"]] == [first, second["id"]]


def test_symlinks_inside_the_package_are_recorded_and_restored(ctx: Context, site: Path, layout: str) -> None:
    (site / "sglang/alias.py").symlink_to("version.py")
    pristine = tree_state(site) | {"link": os.readlink(site / "sglang/alias.py")}
    snap = store.snapshot(ctx, {"reason": "r"})["id"]
    assert read_json(ctx.path("snapshots", snap + ".json"))["files"]["sglang/alias.py"]["link"] == "version.py"
    (site / "sglang/alias.py").unlink()
    (site / "sglang/alias.py").write_text("now a file\n")
    assert transactions.restore(ctx, {"snapshot": snap})["restored"] == ["sglang/alias.py"]
    assert (tree_state(site) | {"link": os.readlink(site / "sglang/alias.py")}) == pristine
    with pytest.raises(HelperFailure) as err:  # apply never writes through a symlink
        transactions.apply(ctx, {"changes": [{"path": "sglang/alias.py", "action": "write", "expect": None,
                                       "sha256": "0" * 64, "content": ""}],
                          "state": {"snapshot": snap, "base_snapshot": snap}})
    assert err.value.code == "path_is_symlink"


@pytest.mark.parametrize(("changes", "code"), [
    ([{"path": SPEC_INFO, "action": "move"}], "bad_plan"),
    ([{"path": MINI_UTILS, "action": "delete"}] * 2, "bad_plan"),
    ([{"path": "../outside.py", "action": "delete"}], "path_escapes"),
])
def test_malformed_apply_requests_are_refused_before_anything_is_written(
        ctx: Context, changes: list[dict[str, str]], code: str) -> None:
    snap = store.snapshot(ctx, {"reason": "r"})["id"]
    with pytest.raises(HelperFailure) as err:
        transactions.apply(ctx, {"changes": changes, "state": {"snapshot": snap, "base_snapshot": snap}})
    assert err.value.code == code
    assert not os.path.exists(ctx.path("journal.json"))


def test_bytecode_of_replaced_modules_is_dropped_and_never_snapshotted(
        ctx: Context, site: Path, mini: Callable[[str], Overlay]) -> None:
    cache = site / "sglang/srt/__pycache__"
    cache.mkdir()
    (cache / "server_args.cpython-311.pyc").write_bytes(b"stale")
    (cache / "constants.cpython-311.pyc").write_bytes(b"kept")
    push_in_process(ctx, mini("0.1.0"))
    assert sorted(p.name for p in cache.iterdir()) == ["constants.cpython-311.pyc"]
    (cache / "server_args.cpython-311.pyc").write_bytes(b"compiled from the overlay")
    snap = store.snapshot(ctx, {"reason": "r"})["id"]
    assert not [p for p in read_json(ctx.path("snapshots", snap + ".json"))["files"] if "__pycache__" in p]
    assert drift.verify(ctx, {})["clean"]
    transactions.restore(ctx, {})
    assert sorted(p.name for p in cache.iterdir()) == ["constants.cpython-311.pyc"]


def test_prune_keeps_the_newest_and_what_rollback_needs_and_frees_the_rest(
        ctx: Context, site: Path, mini: Callable[[str], Overlay], layout: str) -> None:
    pristine = tree_state(site)
    _, base_snap = push_in_process(ctx, mini("0.1.0"))
    on_010 = tree_state(site)
    _, pre_upgrade = push_in_process(ctx, mini("0.2.0"))
    extra = [store.snapshot(ctx, {"reason": "manual"})["id"] for _ in range(3)]
    before = object_count(ctx)
    listing = folder_listing(Path(ctx.state_dir))

    dry = store.prune(ctx, {"keep": 1, "dry_run": True})
    assert folder_listing(Path(ctx.state_dir)) == listing  # a dry run removes nothing
    done = store.prune(ctx, {"keep": 1})
    assert dry["removed"] == done["removed"] == extra[:2]
    # the newest, the rollback target (pre_upgrade) and the base are kept
    assert done["kept"] == [base_snap, pre_upgrade, extra[2]]
    assert [s["id"] for s in store.snapshots(ctx, {})["snapshots"]] == done["kept"]
    assert not any(os.path.exists(ctx.path("snapshots", f"{i}.json")) for i in extra[:2])
    assert object_count(ctx) == before - done["objects_removed"]

    transactions.restore(ctx, {})  # rollback still undoes the deployed overlay, then the base is there too
    assert tree_state(site) == on_010
    transactions.restore(ctx, {"snapshot": base_snap})
    assert tree_state(site) == pristine
    assert store.prune(ctx, {"keep": 5})["removed"] == []


def test_prune_keeps_the_rollback_target_a_kept_snapshot_records(
        ctx: Context, site: Path, mini: Callable[[str], Overlay], layout: str) -> None:
    """A kept snapshot taken while 0.2.0 was deployed records 0.2.0's rollback target: restoring it
    brings that record back, so prune keeps the target too, and a rollback from there still works."""
    _, base_snap = push_in_process(ctx, mini("0.1.0"))
    on_010 = tree_state(site)
    _, pre_upgrade = push_in_process(ctx, mini("0.2.0"))
    manual = store.snapshot(ctx, {"reason": "manual"})["id"]
    transactions.restore(ctx, {"snapshot": base_snap})  # nothing deployed now: state names no target
    assert pre_upgrade in store.prune(ctx, {"keep": 1})["kept"]
    transactions.restore(ctx, {"snapshot": manual})  # 0.2.0's record is back, naming pre_upgrade
    transactions.restore(ctx, {})
    assert tree_state(site) == on_010


def test_prune_removes_the_objects_only_pruned_snapshots_used(ctx: Context, site: Path, layout: str) -> None:
    first = store.snapshot(ctx, {"reason": "a"})["id"]
    (site / SERVER_ARGS).write_bytes(b"# a content only the second snapshot holds\n")
    store.snapshot(ctx, {"reason": "b"})
    (site / SERVER_ARGS).write_bytes(b"# and one only the third holds\n")
    newest = store.snapshot(ctx, {"reason": "c"})["id"]
    at_newest = tree_state(site)
    gone = [manifest_of(ctx, first)["files"][SERVER_ARGS]]
    done = store.prune(ctx, {"keep": 1})
    assert done["kept"] == [newest] and len(done["removed"]) == 2 and first in done["removed"]
    assert done["objects_removed"] == 2  # the two server_args.py contents of the pruned ones
    assert done["bytes_freed"] == gone[0]["size"] + len(b"# a content only the second snapshot holds\n")
    kept = {e["sha256"] for e in manifest_of(ctx, newest)["files"].values()}
    assert sorted(sha for shas in stored_objects(ctx).values() for sha in shas) == sorted(kept)
    (site / SPEC_INFO).unlink()
    (site / SERVER_ARGS).write_bytes(b"")
    transactions.restore(ctx, {"snapshot": newest})  # every object the kept snapshot needs is still there
    assert tree_state(site) == at_newest


@pytest.mark.parametrize("keep", [0, -1, "2", True, None])
def test_prune_refuses_a_bad_keep(ctx: Context, keep: object) -> None:
    with pytest.raises(HelperFailure) as err:
        store.prune(ctx, {"keep": keep})
    assert err.value.code == "bad_request" and "keep" in str(err.value)


def test_prune_refuses_while_a_journal_is_open(ctx: Context, site: Path) -> None:
    snap = store.snapshot(ctx, {"reason": "pre-push"})["id"]
    store.snapshot(ctx, {"reason": "later"})
    Path(ctx.path("journal.json")).write_text(json.dumps({"op": "apply", "snapshot": snap, "paths": []}))
    with pytest.raises(HelperFailure) as err:
        store.prune(ctx, {"keep": 1})
    assert err.value.code == "journal_open"
    assert len(store.snapshots(ctx, {})["snapshots"]) == 2


def test_a_restored_file_changed_before_the_check_keeps_the_journal_open(
        ctx: Context, site: Path, mini: Callable[[str], Overlay], monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore re-reads what it wrote: a file that no longer hashes as the snapshot says is reported."""
    pristine = (site / SERVER_ARGS).read_bytes()
    push_in_process(ctx, mini("0.1.0"))

    def meddle(point: str) -> None:  # someone writes to server_args.py as soon as it is back
        if point.startswith("restore_file_written:") and (site / SERVER_ARGS).read_bytes() == pristine:
            with open(site / SERVER_ARGS, "ab") as f:
                f.write(b"# edited during the restore\n")

    monkeypatch.setattr(transactions, "pause_point", meddle)
    with pytest.raises(HelperFailure) as err:
        transactions.restore(ctx, {})
    assert err.value.code == "restore_unverified" and SERVER_ARGS in err.value.message
    assert read_json(ctx.path("journal.json"))["op"] == "restore"
