"""A full disk or a read-only package folder: every op fails with a clear code and leaves the host bit-exact."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from store_helpers import (
    build_small_site,
    fill,
    folder_listing,
    make_ctx,
    plan_in_process,
    push_in_process,
    remount_ro,
    tmpfs,
    tree_state,
)

from ddtree_deploy.hostside import store, transactions
from ddtree_deploy.hostside.common import HelperFailure
from ddtree_deploy.overlay import Overlay


def host_snapshot(site: Path, state: Path) -> tuple[dict[str, object], dict[str, int]]:
    return tree_state(site), folder_listing(state)


def test_apply_on_a_full_package_disk_changes_nothing(
        pristine: Path, tmp_path: Path, mini: Callable[[str], Overlay]) -> None:
    with tmpfs(tmp_path / "disk", "4m") as disk:
        site = build_small_site(pristine, disk / "site")
        ctx = make_ctx(site, tmp_path / "state")
        the_plan = plan_in_process(ctx, mini("0.1.0"))
        snap = store.snapshot(ctx, {"reason": "pre-push"})["id"]
        fill(disk, 32 * 1024)  # server_args.py alone is ~400 KB
        before = host_snapshot(site, Path(ctx.state_dir))
        with pytest.raises(HelperFailure) as err:
            transactions.apply(ctx, the_plan.helper_args(snap))
        assert err.value.code == "disk_full" and "nothing was changed" in err.value.message
        assert host_snapshot(site, Path(ctx.state_dir)) == before


def test_restore_on_a_full_package_disk_changes_nothing(
        pristine: Path, tmp_path: Path, mini: Callable[[str], Overlay]) -> None:
    with tmpfs(tmp_path / "disk", "4m") as disk:
        site = build_small_site(pristine, disk / "site")
        ctx = make_ctx(site, tmp_path / "state")
        push_in_process(ctx, mini("0.1.0"))
        fill(disk, 32 * 1024)
        before = host_snapshot(site, Path(ctx.state_dir))
        with pytest.raises(HelperFailure) as err:
            transactions.restore(ctx, {})
        assert err.value.code == "disk_full"
        assert host_snapshot(site, Path(ctx.state_dir)) == before


def test_snapshot_into_a_full_state_disk_leaves_the_store_as_it_was(site: Path, tmp_path: Path, layout: str) -> None:
    with tmpfs(tmp_path / "statedisk", "256k") as disk:  # the package holds ~700 KB
        ctx = make_ctx(site, disk)
        ctx.ensure_state_dir()
        before = host_snapshot(site, disk)
        with pytest.raises(HelperFailure) as err:
            store.snapshot(ctx, {"reason": "r"})
        assert err.value.code == "disk_full"
        assert host_snapshot(site, disk) == before


def test_a_first_snapshot_of_the_release_into_a_small_state_disk_leaves_no_pack(
        full_site: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "statedisk", "16m") as disk:  # the release holds ~73 MB, packed in one file
        ctx = make_ctx(full_site, disk)
        ctx.ensure_state_dir()
        before = host_snapshot(full_site, disk)
        with pytest.raises(HelperFailure) as err:
            store.snapshot(ctx, {"reason": "r"})
        assert err.value.code == "disk_full" and "nothing was changed" in err.value.message
        assert host_snapshot(full_site, disk) == before
        assert err.value.message.count("\n") == 0


def test_a_read_only_package_folder_refuses_apply_and_restore_unchanged(
        pristine: Path, tmp_path: Path, mini: Callable[[str], Overlay]) -> None:
    with tmpfs(tmp_path / "disk", "4m") as disk:
        site = build_small_site(pristine, disk / "site")
        ctx = make_ctx(site, tmp_path / "state")
        the_plan = plan_in_process(ctx, mini("0.1.0"))
        snap = store.snapshot(ctx, {"reason": "pre-push"})["id"]
        (site / "sglang/stray.py").write_text("")  # something for restore to remove
        remount_ro(disk)
        before = host_snapshot(site, Path(ctx.state_dir))
        for op, args in ((transactions.apply, the_plan.helper_args(snap)), (transactions.restore, {"snapshot": snap})):
            with pytest.raises(HelperFailure) as err:
                op(ctx, args)
            assert err.value.code == "read_only", op
            assert host_snapshot(site, Path(ctx.state_dir)) == before


def test_apply_with_a_full_state_disk_changes_nothing(
        site: Path, tmp_path: Path, mini: Callable[[str], Overlay]) -> None:
    with tmpfs(tmp_path / "statedisk", "2m") as disk:
        ctx = make_ctx(site, disk)
        the_plan = plan_in_process(ctx, mini("0.1.0"))
        snap = store.snapshot(ctx, {"reason": "pre-push"})["id"]
        fill(disk, 0)
        before = host_snapshot(site, disk)
        with pytest.raises(HelperFailure) as err:
            transactions.apply(ctx, the_plan.helper_args(snap))
        assert err.value.code == "disk_full"
        assert host_snapshot(site, disk) == before


def test_a_full_disk_is_reported_with_the_folder_it_filled(
        pristine: Path, tmp_path: Path, mini: Callable[[str], Overlay], site: Path) -> None:
    """ENOSPC from write(2) names no file; the message names the folder being written instead of ': : '."""
    with tmpfs(tmp_path / "disk", "4m") as disk:
        small = build_small_site(pristine, disk / "site")
        ctx = make_ctx(small, tmp_path / "state")
        the_plan = plan_in_process(ctx, mini("0.1.0"))
        snap = store.snapshot(ctx, {"reason": "pre-push"})["id"]
        fill(disk, 32 * 1024)
        with pytest.raises(HelperFailure) as applied:
            transactions.apply(ctx, the_plan.helper_args(snap))
    with tmpfs(tmp_path / "statedisk", "256k") as state:
        with pytest.raises(HelperFailure) as snapped:
            store.snapshot(make_ctx(site, state), {"reason": "r"})
    for err, folder in ((applied, small), (snapped, state)):
        assert err.value.code == "disk_full"
        assert ": : " not in err.value.message and f": {folder}/" in err.value.message, err.value.message
        assert err.value.message.endswith(": No space left on device")
