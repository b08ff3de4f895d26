"""Journaled transactions on the installed package: `apply` (a plan) and `restore` (a snapshot).

A change stages every byte it needs (objects, temp files beside their targets) before it renames
anything into place, so a full disk or a read-only folder fails with the package untouched. The
journal (`journal.json`, present only while a transaction is open) is written first and removed
last, so a kill at any instant leaves a journal that the next command sees and that `restore`
closes. A restore re-reads only the paths it touched on top of its own scan. Both ops refuse a caller
that does not hold the host lock (`locks.require_lock`).

A journal.json that cannot be read (a disk that filled mid-write, a hand edit) is never replaced
by a made-up one, and only `restore --to SNAPSHOT` closes it: the restore first keeps the damaged
bytes as `journal.json.damaged-<time>-<pid>` (a hard link) and names that copy under `damaged` in its
own journal. If the restore fails before it changes a package file, the damaged bytes go back to
journal.json as they were, so `state` still names the damage and the same rollback can be tried
again. If it stops later, its own journal stays open (a rollback must finish it) and still names the
copy. Only a restore that finishes (package verified, state.json rewritten) removes the copies,
noting the damage in its history line.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import stat
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from .common import (
    TEMP_PREFIX,
    Context,
    HelperFailure,
    append_history,
    damaged_failure,
    fsync_dir,
    os_failure,
    pause_point,
    read_record_or_damage,
    remove_quietly,
    staged_bytes,
    write_json,
)
from .locks import refuse_if_busy, require_lock
from .objects import ObjectStore, hash_file
from .package import Entry, StatCache, checked_path, lstat_or_none, path_entry, scan, sha_of_file
from .store import list_summaries, load_manifest, overlay_label


def write_journal(ctx: Context, journal: Dict[str, Any], what: str) -> None:
    """The first write of a transaction; if it fails (full state disk), nothing has changed yet."""
    try:
        write_json(ctx.path("journal.json"), journal)
    except OSError as exc:
        raise os_failure(exc, what) from None


# ---------------------------------------------------------------- apply


def apply(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Apply a plan as one journaled transaction.

    + changes: [{path, action: write|create|delete, expect: sha256 now on the host or null,
      sha256: post-image or null, mode, content: base64}]
    + state: {overlay, version, digest, snapshot (rollback target), base_snapshot, files}
    """
    refuse_if_busy(ctx, "apply")
    ctx.ensure_state_dir()
    changes = list(args.get("changes") or [])
    new_state = dict(args.get("state") or {})
    check_plan(ctx, changes, new_state)
    targets = [checked_path(ctx, c["path"]) for c in changes]
    check_preimages(ctx, changes, targets, new_state["snapshot"])
    payloads = decode_payloads(changes)
    new_dirs = missing_dirs(ctx, [t for c, t in zip(changes, targets) if c["action"] != "delete"])
    journal = {
        "op": "apply",
        "snapshot": new_state["snapshot"],
        "started": time.time(),
        "by": ctx.owner,
        "overlay": overlay_label(new_state),
        "paths": [c["path"] for c in changes],
        "created": [c["path"] for c in changes if c["action"] == "create"],
        "dirs_created": new_dirs,
    }
    write_journal(ctx, journal, "apply")
    pause_point("journal_written")
    temps = stage_apply(ctx, changes, targets, payloads, new_dirs)
    pause_point("staged")
    commit(ctx, changes, targets, temps)
    forget_bytecode(targets)
    # Unverified until the push's probes pass (`mark_verified`): a push that dies from here on leaves an
    # overlay no probe checked, and the host says so instead of calling it deployed.
    write_json(ctx.path("state.json"), dict(new_state, applied=time.time(), verified=False))
    pause_point("state_written")
    append_history(
        ctx,
        {
            "op": "apply",
            "overlay": overlay_label(new_state),
            "snapshot": new_state["snapshot"],
            "changed": len(changes),
            "by": ctx.owner,
        },
    )
    os.unlink(ctx.path("journal.json"))
    fsync_dir(ctx.state_dir)
    return {
        "changed": len(changes),
        "created": journal["created"],
        "deleted": [c["path"] for c in changes if c["action"] == "delete"],
        "snapshot": new_state["snapshot"],
    }


def check_plan(ctx: Context, changes: List[Dict[str, Any]], new_state: Dict[str, Any]) -> None:
    """The request itself: a snapshot to sit on, each path once, known actions, paths inside the package."""
    paths = [c.get("path") for c in changes]
    problem = None
    if not new_state.get("snapshot") or not new_state.get("base_snapshot"):
        problem = "apply needs state.snapshot and state.base_snapshot"
    elif len(set(paths)) != len(paths):
        problem = "a path appears twice in the plan"
    elif any(c.get("action") not in ("write", "create", "delete") for c in changes):
        problem = "unknown action in the plan"
    if problem:
        raise HelperFailure("bad_plan", problem, "controller and helper disagree; reinstall ddtree-deploy")
    for rel in list(paths) + list(new_state.get("files") or {}):
        checked_path(ctx, rel)


def check_preimages(ctx: Context, changes: List[Dict[str, Any]], targets: List[str], snap_id: str) -> None:
    """Every touched file must still be what the controller planned against and the snapshot recorded."""
    recorded = load_manifest(ctx, snap_id)["files"]
    changed, stale = [], []
    for change, full in zip(changes, targets):
        if os.path.islink(full):
            raise HelperFailure(
                "path_is_symlink",
                "%s is a symlink; refusing to write through it" % change["path"],
                "replace the symlink by the file it points to",
                path=change["path"],
            )
        now = hash_file(full) if os.path.exists(full) else None
        if now != change.get("expect"):
            changed.append(change["path"])
        elif (recorded.get(change["path"]) or {}).get("sha256") != now:
            stale.append(change["path"])
    if changed:
        raise HelperFailure(
            "preimage_changed",
            "files changed since the plan was made: %s" % ", ".join(changed),
            "run the push again (it re-reads the host)",
            paths=changed,
        )
    if stale:
        raise HelperFailure(
            "snapshot_stale",
            "snapshot %s does not record the files as they are now: %s" % (snap_id, ", ".join(stale)),
            "take a new snapshot before applying",
            paths=stale,
        )


def decode_payloads(changes: List[Dict[str, Any]]) -> List[Optional[bytes]]:
    out: List[Optional[bytes]] = []
    for change in changes:
        if change["action"] == "delete":
            out.append(None)
            continue
        data = base64.b64decode(change["content"])
        if hashlib.sha256(data).hexdigest() != change["sha256"]:
            raise HelperFailure(
                "bad_plan",
                "content for %s does not hash to its post-image" % change["path"],
                "the plan was damaged in transit; retry",
                path=change["path"],
            )
        out.append(data)
    return out


def missing_dirs(ctx: Context, targets: List[str]) -> List[str]:
    """Folders a change must create, shallowest first (recorded in the journal, removed by restore)."""
    needed = set()
    for full in targets:
        folder = os.path.dirname(full)
        while not os.path.isdir(folder):
            needed.add(folder)
            folder = os.path.dirname(folder)
    return sorted(needed, key=len)


def stage_apply(
    ctx: Context,
    changes: List[Dict[str, Any]],
    targets: List[str],
    payloads: List[Optional[bytes]],
    new_dirs: List[str],
) -> List[Optional[str]]:
    """Temp files beside every target; on any failure remove them (and the journal) so nothing changed."""
    temps: List[Optional[str]] = []
    try:
        probe_writable([full for change, full in zip(changes, targets) if change["action"] == "delete"])
        for folder in new_dirs:
            os.mkdir(folder, 0o755)
        for change, full, data in zip(changes, targets, payloads):
            if data is None:
                temps.append(None)
                continue
            mode = change.get("mode") or (
                stat.S_IMODE(os.stat(full).st_mode) if os.path.exists(full) else 0o644
            )
            temps.append(staged_bytes(data, os.path.dirname(full), mode))
            pause_point("file_staged:%d" % len(temps))
        ensure_objects(ctx, changes, targets, payloads)
    except OSError as exc:
        undo_staging(ctx, temps, new_dirs)
        raise os_failure(exc, "apply") from None
    except BaseException:
        undo_staging(ctx, temps, new_dirs)
        raise
    return temps


def probe_writable(paths: List[str]) -> None:
    """Prove the folders of files about to be removed or chmodded accept changes, before anything changes."""
    for folder in sorted({os.path.dirname(p) for p in paths}):
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=folder)
        os.close(fd)
        os.unlink(tmp)


def ensure_objects(
    ctx: Context, changes: List[Dict[str, Any]], targets: List[str], payloads: List[Optional[bytes]]
) -> None:
    """The bytes a rollback needs (pre-images, normally stored already) and those drifted files are compared
    with (post-images: `diff --content`, `adopt`) are in the store before anything is replaced."""
    objects = ObjectStore(ctx)
    sources = [(full, change["expect"]) for change, full in zip(changes, targets) if change.get("expect")]
    incoming = objects.from_files(sources, {})
    wanted = {item.sha for item in incoming}
    for change, data in zip(changes, payloads):
        if data is not None and change["sha256"] not in wanted and not objects.has(change["sha256"]):
            incoming.append(ObjectStore.from_bytes(change["sha256"], data))
            wanted.add(change["sha256"])
    objects.add(incoming)


def undo_staging(ctx: Context, temps: List[Optional[str]], new_dirs: List[str]) -> None:
    for tmp in temps:
        if tmp:
            remove_quietly(tmp)
    for folder in reversed(new_dirs):
        try:
            os.rmdir(folder)
        except OSError:
            pass
    remove_quietly(ctx.path("journal.json"))


def commit(
    ctx: Context, changes: List[Dict[str, Any]], targets: List[str], temps: List[Optional[str]]
) -> None:
    """Rename every staged file into place (deletes unlink); the journal stays open if this stops half-way."""
    folders = set()
    for n, (_change, full, tmp) in enumerate(zip(changes, targets, temps), start=1):
        if tmp is None:
            remove_quietly(full)
        else:
            os.replace(tmp, full)
        folders.add(os.path.dirname(full))
        pause_point("file_written:%d" % n)
    for folder in folders:
        fsync_dir(folder)


def forget_bytecode(targets: List[str]) -> None:
    """Drop bytecode of replaced modules: a same-size rewrite within a second could reuse a stale .pyc."""
    for full in targets:
        if not full.endswith(".py"):
            continue
        cache_dir = os.path.join(os.path.dirname(full), "__pycache__")
        stem = os.path.basename(full)[:-3] + "."
        if os.path.isdir(cache_dir):
            for name in os.listdir(cache_dir):
                if name.startswith(stem) and name.endswith(".pyc"):
                    remove_quietly(os.path.join(cache_dir, name))


# ---------------------------------------------------------------- restore


def restore(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Put the package back exactly as `snapshot` recorded it (default: the open journal's, else state's).

    Changed and missing files come back from the store, files the snapshot lacks are removed, modes
    are restored, and the result is re-hashed. An open journal is closed by this op only, a damaged
    one as the module docstring says.
    """
    require_lock(ctx, "restore")
    ctx.ensure_state_dir()
    journal, damage, target = restore_target(ctx, args.get("snapshot"))
    if not target:
        raise HelperFailure(
            "no_snapshot",
            "nothing to restore: no snapshot given and none recorded on the host",
            "pass --to SNAPSHOT (see `ddtree-deploy snapshots`)",
        )
    manifest = load_manifest(ctx, target)
    cache = StatCache(ctx)
    current, dirs = scan(ctx, cache)
    todo = restore_plan(manifest, current, dirs)
    paths = sorted(set(todo["write"]) | set(todo["chmod"]) | set(todo["remove"]))
    opened = {"op": "restore", "snapshot": target, "started": time.time(), "by": ctx.owner, "paths": paths}
    kept = open_restore_journal(ctx, dict(opened, interrupted=journal), damage)
    pause_point("restore_journal_written")
    temps = stage_restore(ctx, manifest, todo, journal, kept)
    commit_restore(ctx, manifest, todo, temps)
    cache.save(ctx)
    verify_restored(ctx, manifest, (current, dirs), todo)
    forget_bytecode([os.path.join(ctx.package_root, p) for p in paths])
    recorded = manifest.get("state") or {}
    if not recorded.get("overlay"):  # a package without overlay is its own base and rollback target
        recorded = {"overlay": None, "version": None, "digest": None, "files": {}, "snapshot": target,
                    "base_snapshot": target}
    write_json(ctx.path("state.json"), dict(recorded, restored_from=target, restored=time.time()))
    append_history(
        ctx,
        {
            "op": "restore",
            "snapshot": target,
            "restored": len(todo["write"]),
            "removed": len(todo["remove"]),
            "closed_journal": journal is not None or damage is not None,
            "damaged_journal": damage_evidence(kept or damaged_in(journal)),
            "by": ctx.owner,
        },
    )
    for copy in damaged_journal_copies(ctx):  # the recovery is complete: the evidence has done its job
        os.unlink(copy)
    os.unlink(ctx.path("journal.json"))
    fsync_dir(ctx.state_dir)
    return {
        "snapshot": target,
        "restored": todo["write"],
        "removed": todo["remove"],
        "modes": todo["chmod"],
        "verified": len(manifest["files"]),
        "closed_journal": journal,
        "damaged_journal": kept,
    }


def restore_target(
    ctx: Context, chosen: Optional[str]
) -> Tuple[Optional[Dict[str, Any]], Optional[Dict[str, str]], Optional[str]]:
    """(the open journal, journal.json's damage, the snapshot to restore): `chosen`, else the journal's, else
    state.json's.

    The store is the truth: with a snapshot chosen, a damaged state.json or journal.json is no
    obstacle (state.json is rewritten, the journal closed as the module docstring says); without
    one, a damaged record is refused by name with the snapshots to choose from.
    """
    journal, journal_damage = read_record_or_damage(ctx, "journal.json")
    state, state_damage = read_record_or_damage(ctx, "state.json")
    damage = journal_damage or (state_damage if journal is None else None)
    if damage is not None and not chosen:
        raise damaged_failure(damage, known=[s["id"] for s in list_summaries(ctx)[-10:]])
    return journal, journal_damage, chosen or (journal or {}).get("snapshot") or (state or {}).get("snapshot")


def open_restore_journal(
    ctx: Context, journal: Dict[str, Any], damage: Optional[Dict[str, str]]
) -> Optional[Dict[str, str]]:
    """Write the restore's journal; over a damaged journal.json, first keep its bytes beside it (a hard link: no
    space needed) and name that copy in the journal. Returns the copy's record (None without damage)."""
    kept = None
    if damage is not None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        kept = dict(damage, path=ctx.path("journal.json.damaged-%s-%d" % (stamp, os.getpid())))
        try:
            os.link(ctx.path("journal.json"), kept["path"])
        except OSError as exc:
            raise os_failure(exc, "restore") from None
        fsync_dir(ctx.state_dir)
    try:
        write_journal(ctx, dict(journal, damaged=kept), "restore")
    except HelperFailure:
        if kept is not None:
            remove_quietly(kept["path"])  # journal.json still holds the damaged bytes: nothing changed
        raise
    return kept


def reopen_journal(ctx: Context, journal: Optional[Dict[str, Any]], kept: Optional[Dict[str, str]]) -> None:
    """Undo `open_restore_journal` when nothing else changed: the journal it was closing goes back as it was
    (a damaged one byte for byte), or none."""
    if kept is not None:
        os.replace(kept["path"], ctx.path("journal.json"))
        fsync_dir(ctx.state_dir)
    elif journal is None:
        remove_quietly(ctx.path("journal.json"))
    else:
        write_json(ctx.path("journal.json"), journal)  # the interrupted push stays reported as before


def damaged_in(journal: Optional[Dict[str, Any]]) -> Optional[Dict[str, str]]:
    """The damaged journal a chain of interrupted restores was closing (the innermost names its copy)."""
    while journal is not None:
        if journal.get("damaged"):
            found: Dict[str, str] = journal["damaged"]
            return found
        journal = journal.get("interrupted")
    return None


def damage_evidence(kept: Optional[Dict[str, str]]) -> Optional[Dict[str, Any]]:
    """What the history line keeps of a damaged journal once its copy is removed: why, and its size."""
    if kept is None:
        return None
    size = os.path.getsize(kept["path"]) if os.path.exists(kept["path"]) else None
    return {"file": kept["file"], "error": kept["error"], "size": size}


def damaged_journal_copies(ctx: Context) -> List[str]:
    """The damaged journals that restores kept beside journal.json (see the module docstring)."""
    prefix = "journal.json.damaged-"
    return sorted(ctx.path(name) for name in os.listdir(ctx.state_dir) if name.startswith(prefix))


def restore_plan(
    manifest: Dict[str, Any], current: Dict[str, Entry], dirs: Dict[str, int]
) -> Dict[str, List[str]]:
    want: Dict[str, Entry] = manifest["files"]
    write = [
        p
        for p, e in want.items()
        if p not in current or current[p]["sha256"] != e["sha256"] or ("link" in current[p]) != ("link" in e)
    ]
    chmod = [
        p
        for p, e in want.items()
        if p in current and p not in write and "link" not in e and current[p]["mode"] != e["mode"]
    ]
    chmod += [d + "/" for d, mode in manifest["dirs"].items() if d in dirs and dirs[d] != mode]
    remove = sorted(p for p in current if p not in want)
    rmdir = sorted((d for d in dirs if d not in manifest["dirs"]), key=len, reverse=True)
    mkdir = sorted((d for d in manifest["dirs"] if d not in dirs), key=len)
    return {"write": sorted(write), "chmod": chmod, "remove": remove, "rmdir": rmdir, "mkdir": mkdir}


def stage_restore(
    ctx: Context,
    manifest: Dict[str, Any],
    todo: Dict[str, List[str]],
    journal: Optional[Dict[str, Any]],
    kept: Optional[Dict[str, str]],
) -> Dict[str, str]:
    """Temp copies of every file to bring back, checked against their hashes; undone completely on failure."""
    temps: Dict[str, str] = {}
    made: List[str] = []
    write, mkdir = todo["write"], todo["mkdir"]
    objects = ObjectStore(ctx)
    try:
        probe_writable(
            [
                os.path.join(ctx.package_root, p.rstrip("/"))
                for p in todo["remove"] + todo["chmod"] + todo["rmdir"]
            ]
        )
        for rel in mkdir:
            full = os.path.join(ctx.package_root, rel)
            os.mkdir(full)
            made.append(full)
            os.chmod(full, manifest["dirs"][rel])
        for rel in write:
            entry = manifest["files"][rel]
            folder = os.path.dirname(checked_path(ctx, rel))
            if "link" in entry:
                temps[rel] = staged_link(entry["link"], folder)
            else:
                temps[rel] = objects.staged_copy(entry["sha256"], folder, entry["mode"])
    except BaseException as exc:
        for tmp in temps.values():
            remove_quietly(tmp)
        for full in reversed(made):
            shutil.rmtree(full, ignore_errors=True)
        reopen_journal(ctx, journal, kept)
        if isinstance(exc, OSError):
            raise os_failure(exc, "restore") from None
        raise
    return temps


def staged_link(target: str, folder: str) -> str:
    tmp = os.path.join(folder, TEMP_PREFIX + base64.b32encode(os.urandom(10)).decode().lower())
    os.symlink(target, tmp)
    return tmp


def commit_restore(
    ctx: Context, manifest: Dict[str, Any], todo: Dict[str, List[str]], temps: Dict[str, str]
) -> None:
    root = ctx.package_root
    for n, rel in enumerate(todo["write"], start=1):
        os.replace(temps[rel], os.path.join(root, rel))
        pause_point("restore_file_written:%d" % n)
    for rel in todo["chmod"]:
        mode = manifest["dirs"][rel[:-1]] if rel.endswith("/") else manifest["files"][rel]["mode"]
        os.chmod(os.path.join(root, rel.rstrip("/")), mode)
    for rel in todo["remove"]:
        os.unlink(os.path.join(root, rel))
    for rel in todo["rmdir"]:
        shutil.rmtree(os.path.join(root, rel))  # what remains is derived (__pycache__) or already gone
    for folder in {os.path.dirname(os.path.join(root, p)) for p in todo["write"] + todo["remove"]}:
        if os.path.isdir(folder):
            fsync_dir(folder)


def verify_restored(
    ctx: Context,
    manifest: Dict[str, Any],
    scanned: Tuple[Dict[str, Entry], Dict[str, int]],
    todo: Dict[str, List[str]],
) -> None:
    """Re-read every path the restore touched (written files re-hashed) and check that the package, as this
    op's scan found it with those paths as they are now, is exactly the snapshot; a mismatch keeps the
    journal open. The paths it did not touch were compared with the snapshot by that scan a moment ago,
    so a second walk of the whole package would only read their stats again."""
    files, dirs = dict(scanned[0]), dict(scanned[1])
    root = ctx.package_root
    for rel in todo["write"] + [p for p in todo["chmod"] if not p.endswith("/")] + todo["remove"]:
        entry = path_entry(root + "/" + rel, sha_of_file)
        if entry is None:
            files.pop(rel, None)
        else:
            files[rel] = entry
    for folder in todo["mkdir"] + [p[:-1] for p in todo["chmod"] if p.endswith("/")] + todo["rmdir"]:
        st = lstat_or_none(root + "/" + folder)
        if st is None:
            dirs.pop(folder, None)
        else:
            dirs[folder] = stat.S_IMODE(st.st_mode)
    if files != manifest["files"] or dirs != manifest["dirs"]:
        differ = sorted(
            p for p in set(files) | set(manifest["files"]) if files.get(p) != manifest["files"].get(p)
        ) or sorted(d + "/" for d in set(dirs) | set(manifest["dirs"]) if dirs.get(d) != manifest["dirs"].get(d))
        raise HelperFailure(
            "restore_unverified",
            "after restore, %d paths differ from snapshot %s: %s"
            % (len(differ), manifest["id"], ", ".join(differ[:5])),
            "run rollback again; the journal stays open",
            paths=differ[:50],
        )


OPS = {"apply": apply, "restore": restore}
