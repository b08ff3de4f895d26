"""Packs in the object store: when a batch is packed, reads checked from packs, kills and failures mid-pack, prune."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from store_helpers import corrupt_object, folder_listing, run_and_kill, stored_objects, tree_state

from ddtree_deploy.hostside import common, objects, store, transactions
from ddtree_deploy.hostside.common import Context, HelperFailure

SERVER_ARGS = "sglang/srt/server_args.py"
SPEC_INFO = "sglang/srt/speculative/spec_info.py"
VERSION = "sglang/version.py"


def manifest_of(ctx: Context, snap_id: str) -> dict[str, Any]:
    return json.loads(Path(ctx.path("snapshots", snap_id + ".json")).read_text())


def pack_folder(ctx: Context) -> list[str]:
    folder = Path(ctx.path("objects", "pack"))
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def leftovers(ctx: Context) -> list[str]:
    return [str(p) for p in Path(ctx.path("objects")).rglob("*")
            if p.name.startswith(common.TEMP_PREFIX) or (p.suffix in (".idx", ".pack") and
                                                          not Path(objects.other_half(str(p))).exists())]


def test_rollback_from_a_cold_snapshots_pack_is_bit_exact(full_ctx: Context, full_site: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pristine = tree_state(full_site)
    writebacks: list[int] = []
    real_fadvise = os.posix_fadvise

    def counting(fd: int, offset: int, length: int, advice: int) -> None:
        writebacks.append(length)
        real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", counting)
    snap = store.snapshot(full_ctx, {"reason": "cold"})
    assert len(writebacks) >= 5  # the pack was streamed during the scan, its pages sent to disk as it grew
    assert [n.rsplit(".", 1)[1] for n in pack_folder(full_ctx)] == ["idx", "pack"]
    assert list(stored_objects(full_ctx)) == [pack_folder(full_ctx)[1]]  # nothing loose
    removed = sorted(p for p in pristine if p.startswith("sglang/srt/layers/") and not p.endswith("/"))
    for rel in removed:
        (full_site / rel).unlink()
    (full_site / SERVER_ARGS).write_text("edited\n")
    result = transactions.restore(full_ctx, {"snapshot": snap["id"]})
    assert len(result["restored"]) == len(removed) + 1 > 300
    assert tree_state(full_site) == pristine


def test_a_cold_snapshot_reads_each_file_once(ctx: Context, site: Path, layout: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    real = objects.file_chunks

    def counting(path: str) -> Iterator[bytes]:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(objects, "file_chunks", counting)
    snap = store.snapshot(ctx, {"reason": "cold"})
    assert reads == [] and snap["new_objects"] == 7  # stored from the bytes the scan hashed
    stored = objects.ObjectStore(ctx)
    for rel, entry in manifest_of(ctx, snap["id"])["files"].items():
        assert stored.read(entry["sha256"]) == (site / rel).read_bytes()
    assert (list(stored_objects(ctx)) == ["loose"]) == (layout == "loose")


def test_a_failure_mid_scan_with_the_pack_open_leaves_the_store_as_it_was(
        full_ctx: Context, monkeypatch: pytest.MonkeyPatch) -> None:
    full_ctx.ensure_state_dir()
    before = folder_listing(Path(full_ctx.state_dir))
    real_read, reads = objects.read_to_end, []

    def failing(fd: int, size: int) -> bytes:
        reads.append(size)
        if len(reads) == 2000:  # well after the pack opened (at PACK_MIN new contents)
            raise OSError(errno.EIO, "Input/output error")
        return real_read(fd, size)

    monkeypatch.setattr(objects, "read_to_end", failing)
    with pytest.raises(HelperFailure) as err:
        store.snapshot(full_ctx, {"reason": "r"})
    assert err.value.code == "os_error" and "nothing was changed" in err.value.message
    assert folder_listing(Path(full_ctx.state_dir)) == before  # the half-written pack is gone


def test_a_file_that_changes_before_its_second_read_aborts_the_streamed_pack(
        ctx: Context, site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objects, "PACK_MIN", 1)
    ctx.ensure_state_dir()
    (site / VERSION).write_text("__version__ = 'local'\n")  # too recent to trust one read: read again
    before = folder_listing(Path(ctx.state_dir))
    opened: list[objects.PackWriter] = []
    real_init = objects.PackWriter.__init__

    def recording(self: objects.PackWriter, store_: objects.ObjectStore) -> None:
        real_init(self, store_)
        opened.append(self)

    def edited_meanwhile(path: str) -> Iterator[bytes]:
        yield b"__version__ = 'edited between the scan and the store'\n"

    monkeypatch.setattr(objects.PackWriter, "__init__", recording)
    monkeypatch.setattr(objects, "file_chunks", edited_meanwhile)
    with pytest.raises(HelperFailure) as err:
        store.snapshot(ctx, {"reason": "r"})
    assert err.value.code == "content_changed" and VERSION in err.value.message
    assert opened and opened[0].index  # the pack was streaming the steady files when the refusal came
    assert folder_listing(Path(ctx.state_dir)) == before


def test_a_full_disk_when_the_pack_is_opened_leaves_the_store_as_it_was(
        full_ctx: Context, monkeypatch: pytest.MonkeyPatch) -> None:
    full_ctx.ensure_state_dir()
    before = folder_listing(Path(full_ctx.state_dir))

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(objects.tempfile, "mkstemp", full)
    with pytest.raises(HelperFailure) as err:
        store.snapshot(full_ctx, {"reason": "r"})
    assert err.value.code == "disk_full"
    assert folder_listing(Path(full_ctx.state_dir)) == before  # not even an empty pack folder


def test_a_file_changed_between_hashing_and_storing_is_refused(
        ctx: Context, site: Path, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store.snapshot(ctx, {"reason": "first"})
    (site / VERSION).write_text("__version__ = 'local'\n")  # written just now: too recent to trust one read
    before = folder_listing(Path(ctx.state_dir))
    real_add = objects.ObjectStore.add

    def add_after_an_edit(self: objects.ObjectStore, items: list[objects.Incoming]) -> objects.Added:
        (site / VERSION).write_text("__version__ = 'edited while the snapshot ran'\n")
        return real_add(self, items)

    monkeypatch.setattr(objects.ObjectStore, "add", add_after_an_edit)
    with pytest.raises(HelperFailure) as err:
        store.snapshot(ctx, {"reason": "second"})
    assert err.value.code == "content_changed" and VERSION in err.value.message
    assert folder_listing(Path(ctx.state_dir)) == before


def test_a_file_that_grew_after_its_stat_is_hashed_whole_and_not_kept(ctx: Context, tmp_path: Path) -> None:
    grown = tmp_path / "grown.py"
    grown.write_bytes(b"a" * 10)
    st = os.stat(grown)  # the scan's stat, then the file grows before it is read
    grown.write_bytes(b"b" * (3 * objects.CHUNK + 7))
    collector = objects.Collector(objects.ObjectStore(ctx), racy_after_ns=st.st_mtime_ns + 1)
    assert collector.hash(str(grown), st) == hashlib.sha256(grown.read_bytes()).hexdigest()
    assert collector.kept == {}  # its stat changed: stored from a second read, checked against this hash


def test_a_corrupt_stored_byte_is_refused_on_restore_and_changes_nothing(
        ctx: Context, site: Path, layout: str) -> None:
    snap = store.snapshot(ctx, {"reason": "r"})["id"]
    corrupt_object(ctx, manifest_of(ctx, snap)["files"][SERVER_ARGS]["sha256"])
    (site / SERVER_ARGS).write_text("edited\n")
    (site / SPEC_INFO).unlink()
    before, listing = tree_state(site), folder_listing(Path(ctx.state_dir))
    with pytest.raises(HelperFailure) as err:
        transactions.restore(ctx, {"snapshot": snap})
    assert err.value.code == "object_corrupt"
    assert tree_state(site) == before and folder_listing(Path(ctx.state_dir)) == listing  # no journal either
    with pytest.raises(HelperFailure) as err:  # a plan reading the recorded content is refused too
        store.read_files(ctx, {"paths": [SERVER_ARGS], "want_content": [SERVER_ARGS], "snapshot": snap})
    assert err.value.code == "object_corrupt"


@pytest.mark.parametrize("point", ["pack_written", "pack_indexed"])
def test_an_exception_mid_pack_leaves_the_store_as_it_was(
        ctx: Context, site: Path, point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objects, "PACK_MIN", 1)
    store.snapshot(ctx, {"reason": "first"})
    (site / SERVER_ARGS).write_text("edited\n")
    before = folder_listing(Path(ctx.state_dir))

    def boom(at: str) -> None:
        if at == point:
            raise KeyboardInterrupt(at)

    monkeypatch.setattr(store, "pause_point", boom)
    with pytest.raises(KeyboardInterrupt):
        store.snapshot(ctx, {"reason": "second"})
    assert folder_listing(Path(ctx.state_dir)) == before


@pytest.mark.parametrize("failing", ["index", "manifest"])
def test_a_full_disk_after_the_pack_is_written_leaves_the_store_as_it_was(
        ctx: Context, failing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objects, "PACK_MIN", 1)
    ctx.ensure_state_dir()
    before = folder_listing(Path(ctx.state_dir))
    real = common.atomic_write

    def full(path: str, data: bytes, mode: int = 0o600) -> None:
        if path.endswith(".idx" if failing == "index" else ".json"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real(path, data, mode)

    monkeypatch.setattr(objects if failing == "index" else store, "atomic_write", full)
    with pytest.raises(HelperFailure) as err:
        store.snapshot(ctx, {"reason": "r"})
    assert err.value.code == "disk_full" and "nothing was changed" in err.value.message
    assert folder_listing(Path(ctx.state_dir)) == before


@pytest.mark.parametrize("point", ["pack_written", "pack_indexed"])
def test_a_snapshot_killed_mid_pack_leaves_a_valid_store_that_prune_cleans(
        ctx: Context, site: Path, point: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objects, "PACK_MIN", 1)
    first = store.snapshot(ctx, {"reason": "first"})["id"]
    pristine, stored = tree_state(site), stored_objects(ctx)
    (site / SERVER_ARGS).write_text("edited\n")
    (site / SPEC_INFO).write_text("edited too\n")
    run_and_kill(lambda: store.snapshot(ctx, {"reason": "killed"}), point, tmp_path)
    assert [s["id"] for s in store.snapshots(ctx, {})["snapshots"]] == [first]
    assert stored_objects(ctx) == stored and leftovers(ctx)  # what the kill left does not count

    edited = tree_state(site)
    second = store.snapshot(ctx, {"reason": "again"})
    assert second["new_objects"] == 2
    transactions.restore(ctx, {"snapshot": first})
    assert tree_state(site) == pristine
    transactions.restore(ctx, {"snapshot": second["id"]})
    assert tree_state(site) == edited
    pruned = store.prune(ctx, {"keep": 5})
    assert pruned["objects_removed"] == 0 and pruned["bytes_freed"] > 0  # the killed run's temp pack
    assert leftovers(ctx) == [] and len(pack_folder(ctx)) == 4


@pytest.mark.parametrize("rewrite_min", [1, 6], ids=["rewritten-as-a-pack", "rewritten-loose"])
def test_prune_deletes_an_unused_pack_and_rewrites_a_partly_used_one(
        ctx: Context, site: Path, rewrite_min: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objects, "PACK_MIN", 1)
    first = store.snapshot(ctx, {"reason": "a"})["id"]  # pack A: 7 contents
    for n in range(2):  # pack B, then pack C: 2 contents each
        (site / SERVER_ARGS).write_text(f"server args {n}\n")
        (site / SPEC_INFO).write_text(f"spec info {n}\n")
        newest = store.snapshot(ctx, {"reason": str(n)})["id"]
    at_newest = tree_state(site)
    packs = {name: set(shas) for name, shas in stored_objects(ctx).items()}
    assert len(packs) == 3 and sorted(len(s) for s in packs.values()) == [2, 2, 7]
    used = {e["sha256"] for e in manifest_of(ctx, newest)["files"].values()}
    ids = [s["id"] for s in store.snapshots(ctx, {})["snapshots"]]
    unused = {e["sha256"]: e["size"] for i in ids for e in manifest_of(ctx, i)["files"].values()
              if e["sha256"] not in used}

    monkeypatch.setattr(objects, "PACK_MIN", rewrite_min)  # 5 of pack A's contents stay in use
    done = store.prune(ctx, {"keep": 1})
    assert done["kept"] == [newest] and first in done["removed"]
    assert (done["objects_removed"], done["bytes_freed"]) == (4, sum(unused.values()))
    after = stored_objects(ctx)
    assert sorted(sha for shas in after.values() for sha in shas) == sorted(used)
    assert sorted(len(s) for s in after.values()) == [2, 5]  # pack C, and A's 5 used contents
    assert ("loose" in after) == (rewrite_min == 6) and leftovers(ctx) == []

    for rel in (SERVER_ARGS, SPEC_INFO, VERSION):
        (site / rel).unlink()
    transactions.restore(ctx, {"snapshot": newest})
    assert tree_state(site) == at_newest


def test_prune_killed_after_rewriting_a_pack_keeps_every_object_and_the_next_prune_finishes(
        ctx: Context, site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(objects, "PACK_MIN", 1)
    store.snapshot(ctx, {"reason": "a"})
    (site / SERVER_ARGS).write_text("edited\n")
    newest = store.snapshot(ctx, {"reason": "b"})["id"]
    at_newest = tree_state(site)
    used = sorted(e["sha256"] for e in manifest_of(ctx, newest)["files"].values())
    run_and_kill(lambda: store.prune(ctx, {"keep": 1}), "pack_rewritten", tmp_path)
    assert len(stored_objects(ctx)) == 3  # the old pack A, its rewrite A' and pack B: nothing lost

    (site / SERVER_ARGS).unlink()
    transactions.restore(ctx, {"snapshot": newest})
    assert tree_state(site) == at_newest
    done = store.prune(ctx, {"keep": 1})
    assert done["removed"] == [] and done["objects_removed"] == 1  # the old server_args.py, still in A
    after = stored_objects(ctx)
    assert len(after) == 2 and sorted(sha for shas in after.values() for sha in shas) == used
