"""The host's content-addressed store and its journaled transactions on the installed package.

Ops: `snapshot`, `snapshots`, `read_files`, `apply`, `restore`, `verify`, `prune`. The package is the
`sglang/` folder plus its `sglang-<version>.dist-info/` in the package root; `__pycache__` folders
are derived data and never part of it. State layout under ctx.state_dir:

    objects/                  file contents by sha256, loose or packed (objects.py owns them)
    snapshots/<id>.json       manifest: files {path: {sha256, mode, size} or {link}}, dirs, state, ...
    snapshots/index.jsonl     one summary line per snapshot (so listing never parses manifests)
    snapshots/statcache.json  (size, mtime_ns, ctime_ns, inode) -> sha256, like git's index
    state.json                what is deployed: overlay, version, digest, snapshot, base_snapshot,
                              files {path: {sha256, mode} or null} (the overlay's post-images)
    journal.json              present only while apply or restore is open

A change stages every byte it needs (objects, temp files beside their targets) before it renames
anything into place, so a full disk or a read-only folder fails with the package untouched. The
journal is written first and removed last, so a kill at any instant leaves a journal that the next
command sees and that `restore` closes.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from .common import (
    TEMP_PREFIX,
    Context,
    HelperFailure,
    append_history,
    atomic_write,
    fsync_dir,
    read_json,
    remove_quietly,
    staged_bytes,
    write_json,
)
from .locks import read_lock
from .objects import Added, Collector, ObjectStore, hash_file

PACKAGE = "sglang"
DIST_INFO = re.compile(r"^%s-[0-9][^-/]*\.dist-info$" % PACKAGE)
DERIVED_DIRS = ("__pycache__",)
#: entries modified this close to a scan are re-hashed next time (git's "racily clean" rule)
RACY_NS = 2 * 10**9

Entry = Dict[str, Any]  # {"sha256", "mode", "size"} or {"link", "mode", "size", "sha256"}
Reader = Callable[[str, os.stat_result], str]  # hashes a file the stat cache cannot answer for


# ---------------------------------------------------------------- test hook


def pause_point(point: str) -> None:
    """Test hook: with DDTREE_TEST_PAUSE_AT=<point>, note our pid and sleep so a test can SIGKILL us here."""
    if os.environ.get("DDTREE_TEST_PAUSE_AT") != point:
        return
    signal_file = os.environ.get("DDTREE_TEST_PAUSE_SIGNAL")
    if signal_file:
        with open(signal_file, "w") as f:
            f.write(str(os.getpid()))
    time.sleep(float(os.environ.get("DDTREE_TEST_PAUSE_S", "60")))


# ---------------------------------------------------------------- paths


def package_dirs(root: str) -> List[str]:
    """The top-level folders that make up the package: sglang/ and its dist-info."""
    names = [PACKAGE] if os.path.isdir(os.path.join(root, PACKAGE)) else []
    return names + sorted(
        n for n in os.listdir(root) if DIST_INFO.match(n) and os.path.isdir(os.path.join(root, n))
    )


def checked_path(ctx: Context, rel: Any) -> str:
    """Absolute path of package-relative `rel`; refused if it escapes the package (.., absolute, symlinks)."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        raise HelperFailure(
            "path_escapes",
            "path %r is not relative to the package root" % (rel,),
            "paths are relative to the folder holding sglang/",
            path=rel,
        )
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts) or (parts[0] != PACKAGE and not DIST_INFO.match(parts[0])):
        raise HelperFailure(
            "path_escapes",
            "path %r is outside the %s package" % (rel, PACKAGE),
            "paths must stay under sglang/ or its dist-info",
            path=rel,
        )
    full = os.path.join(ctx.package_root, rel)
    root = os.path.realpath(ctx.package_root)
    if not os.path.realpath(os.path.dirname(full)).startswith(root + os.sep):
        raise HelperFailure(
            "path_escapes",
            "%s: a folder on the way is a symlink leading outside %s" % (rel, root),
            "remove the symlink on the host",
            path=rel,
        )
    if os.path.islink(full) and not os.path.realpath(full).startswith(root + os.sep):
        raise HelperFailure(
            "path_escapes",
            "%s is a symlink to %s, outside the package root" % (rel, os.path.realpath(full)),
            "remove the symlink on the host",
            path=rel,
        )
    return full


# ---------------------------------------------------------------- hashing and scanning


def link_entry(path: str, st: os.stat_result) -> Entry:
    target = os.readlink(path)
    return {
        "link": target,
        "sha256": hashlib.sha256(target.encode()).hexdigest(),
        "mode": stat.S_IMODE(st.st_mode),
        "size": len(target),
    }


def walk_package(root: str) -> Iterator[Tuple[str, Optional[os.stat_result]]]:
    """(relpath, lstat) of every file and symlink, (relpath/, None) of every folder; no __pycache__."""
    stack = [d for d in reversed(package_dirs(root))]
    while stack:
        rel = stack.pop()
        yield rel + "/", None
        with os.scandir(root + "/" + rel) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in reversed(entries):
            child = rel + "/" + entry.name  # not os.path.join: this runs per file
            if entry.is_dir(follow_symlinks=False):
                if entry.name not in DERIVED_DIRS:
                    stack.append(child)
            else:  # temp files left by a killed run are listed too: restore removes them
                yield child, entry.stat(follow_symlinks=False)


class StatCache:
    """sha256 by (size, mtime_ns, ctime_ns, inode): a file whose stat is unchanged is not read again."""

    def __init__(self, ctx: Context) -> None:
        self.path = ctx.path("snapshots", "statcache.json")
        loaded = read_json(self.path, default=None) or {}
        self.entries = loaded.get("entries", {}) if loaded.get("root") == ctx.package_root else {}
        self.fresh: Dict[str, List[Any]] = {}
        self.started_ns = time.time_ns()

    def sha(self, full: str, rel: str, st: os.stat_result, force: bool = False, read: Optional[Reader] = None) -> str:
        key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        cached = self.entries.get(rel)
        if not force and cached and cached[:4] == key:
            sha = str(cached[4])
        else:
            sha = read(full, st) if read else hash_file(full)
        if st.st_mtime_ns < self.started_ns - RACY_NS:
            self.fresh[rel] = key + [sha]
        return sha

    def save(self, ctx: Context) -> None:
        if self.fresh != self.entries and os.path.isdir(os.path.dirname(self.path)):
            body = {"root": ctx.package_root, "entries": self.fresh}
            atomic_write(self.path, json.dumps(body, separators=(",", ":")).encode())


def scan(
    ctx: Context, cache: StatCache, rehash: Tuple[str, ...] = (), read: Optional[Reader] = None
) -> Tuple[Dict[str, Entry], Dict[str, int]]:
    """Every file of the package with its hash, mode and size, and every folder with its mode.

    `read` hashes the files the stat cache cannot answer for (default: `hash_file`).
    """
    files: Dict[str, Entry] = {}
    dirs: Dict[str, int] = {}
    prefix = len(ctx.package_root) + 1

    def sha_of(full: str, st: os.stat_result) -> str:
        rel = full[prefix:]
        return cache.sha(full, rel, st, force=rel in rehash, read=read)

    for rel, st in walk_package(ctx.package_root):
        full = ctx.package_root + "/" + rel
        if st is None:
            dirs[rel.rstrip("/")] = stat.S_IMODE(os.lstat(full).st_mode)
            continue
        entry = entry_of(full, st, sha_of)
        if entry is not None:
            files[rel] = entry
    return files, dirs


def entry_of(full: str, st: os.stat_result, sha_of: Callable[[str, os.stat_result], str]) -> Optional[Entry]:
    """A file's manifest entry (hash, mode, size; a symlink's target); None for anything else (a socket)."""
    if stat.S_ISLNK(st.st_mode):
        return link_entry(full, st)
    if stat.S_ISREG(st.st_mode):
        return {"sha256": sha_of(full, st), "mode": stat.S_IMODE(st.st_mode), "size": st.st_size}
    return None


def sha_of_file(full: str, st: os.stat_result) -> str:
    return hash_file(full)


# ---------------------------------------------------------------- manifests, state, journal


def manifest_path(ctx: Context, snap_id: str) -> str:
    if not isinstance(snap_id, str) or not re.match(r"^[0-9A-Za-z-]+$", snap_id):
        raise HelperFailure(
            "unknown_snapshot",
            "snapshot id %r is not a valid id" % (snap_id,),
            "list them with `ddtree-deploy snapshots --host HOST`",
        )
    return ctx.path("snapshots", snap_id + ".json")


def load_manifest(ctx: Context, snap_id: str) -> Dict[str, Any]:
    manifest: Optional[Dict[str, Any]] = read_json(manifest_path(ctx, snap_id))
    if manifest is None:
        known = [s["id"] for s in list_summaries(ctx)[-5:]]
        raise HelperFailure(
            "unknown_snapshot",
            "no snapshot %s on this host" % snap_id,
            "known snapshots (newest last): %s" % (", ".join(known) or "none"),
            known=known,
        )
    return manifest


def refuse_if_busy(ctx: Context) -> None:
    """A change refuses while a journal is open (interrupted operation) or another owner holds the lock."""
    journal = read_json(ctx.path("journal.json"))
    if journal is not None:
        raise HelperFailure(
            "journal_open",
            "an interrupted %s (snapshot %s) left an open journal"
            % (journal.get("op"), journal.get("snapshot")),
            "run `ddtree-deploy rollback` to restore snapshot %s" % journal.get("snapshot"),
            journal=journal,
        )
    held = read_lock(ctx)
    if held and held.get("owner") != ctx.owner and held.get("expires", 0) > time.time():
        raise HelperFailure(
            "locked",
            "host is locked by %s" % held.get("owner"),
            "wait for that operation to finish",
            holder=held,
        )


def write_journal(ctx: Context, journal: Dict[str, Any], what: str) -> None:
    """The first write of a transaction; if it fails (full state disk), nothing has changed yet."""
    try:
        write_json(ctx.path("journal.json"), journal)
    except OSError as exc:
        raise os_failure(exc, what) from None


def os_failure(exc: OSError, what: str) -> HelperFailure:
    """A staging failure, said plainly: nothing on the host was changed."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        code, hint = "disk_full", "free space on the host (package folder and state folder) and retry"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        code, hint = "read_only", "make the folder writable for the deploying user and retry"
    else:
        code, hint = "os_error", "check the host's file system"
    return HelperFailure(
        code,
        "%s failed, nothing was changed: %s: %s" % (what, exc.filename or "", exc.strerror),
        hint,
        errno=exc.errno,
    )


# ---------------------------------------------------------------- snapshot


def snapshot(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Record every file of the package into the store; only new contents are copied.

    + reason: why (e.g. "pre-push"); fingerprint: the host's fingerprint, kept verbatim;
      overlay: what is deployed (default: state.json's record).
    """
    ctx.ensure_state_dir()
    refuse_if_busy(ctx)
    started = time.time()
    cache = StatCache(ctx)
    objects = ObjectStore(ctx, pause_point)
    collector = Collector(objects, cache.started_ns - RACY_NS)
    added = Added()
    try:
        files, dirs = scan(ctx, cache, read=collector.hash)  # a first snapshot's pack fills as it goes
        sources = [(ctx.package_root + "/" + rel, e["sha256"]) for rel, e in files.items() if "link" not in e]
        added = collector.store_rest(sources)
        state = read_json(ctx.path("state.json"))
        digest = files_digest(files)
        snap_id = (
            time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
            + "-"
            + hashlib.sha256(("%s%d" % (digest, time.time_ns())).encode()).hexdigest()[:8]
        )
        manifest = {
            "id": snap_id,
            "time": started,
            "reason": str(args.get("reason") or ""),
            "fingerprint": args.get("fingerprint"),
            "package_root": ctx.package_root,
            "overlay": args.get("overlay") or overlay_label(state),
            "state": state,
            "dirs": dirs,
            "files": files,
        }
        atomic_write(manifest_path(ctx, snap_id), json.dumps(manifest, separators=(",", ":")).encode())
    except BaseException as exc:
        collector.abort()
        added.undo()  # the store stays exactly as it was
        if isinstance(exc, OSError):
            raise os_failure(exc, "snapshot") from None
        raise
    summary = summarize(manifest, digest)
    try:  # both are conveniences: the manifest alone is the record
        index_append(ctx, summary)
        cache.save(ctx)
    except OSError:
        pass
    previous = list_summaries(ctx)
    same = [s["id"] for s in previous[:-1] if s.get("digest") == summary["digest"]]
    append_history(ctx, {"op": "snapshot", "id": snap_id, "reason": manifest["reason"], "by": ctx.owner})
    return dict(
        summary,
        new_objects=added.objects,
        new_bytes=added.bytes,
        bytes=sum(e["size"] for e in files.values()),
        same_as=same[-1] if same else None,
        seconds=round(time.time() - started, 3),
    )


def overlay_label(state: Optional[Dict[str, Any]]) -> Optional[str]:
    if state and state.get("overlay"):
        return "%s@%s" % (state["overlay"], state.get("version"))
    return None


def files_digest(files: Dict[str, Entry]) -> str:
    """The digest of a manifest's files: equal digests mean the package was exactly the same."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def summarize(manifest: Dict[str, Any], digest: Optional[str] = None) -> Dict[str, Any]:
    """The index row of a manifest (`digest`: its files' digest, when the caller has it already)."""
    files = manifest["files"]
    return {
        "id": manifest["id"],
        "time": manifest["time"],
        "reason": manifest["reason"],
        "files": len(files),
        "overlay": manifest.get("overlay"),
        "fingerprint": manifest.get("fingerprint"),  # what restore compares the host against
        "digest": digest or files_digest(files),
    }


def index_append(ctx: Context, summary: Dict[str, Any]) -> None:
    fd = os.open(ctx.path("snapshots", "index.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(summary, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def list_summaries(ctx: Context) -> List[Dict[str, Any]]:
    """Every snapshot with a manifest, oldest first; one missing from the index is summarized directly."""
    folder = ctx.path("snapshots")
    if not os.path.isdir(folder):
        return []
    ids = {n[:-5] for n in os.listdir(folder) if n.endswith(".json") and n != "statcache.json"}
    indexed: Dict[str, Dict[str, Any]] = {}
    try:
        with open(os.path.join(folder, "index.jsonl"), "rb") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash; the manifest still speaks for itself
                indexed[row["id"]] = row
    except FileNotFoundError:
        pass
    for missing in ids - set(indexed):
        manifest = read_json(os.path.join(folder, missing + ".json"))
        if manifest:
            indexed[missing] = summarize(manifest)
    return sorted((indexed[i] for i in ids if i in indexed), key=lambda s: (s["time"], s["id"]))


def snapshots(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """List snapshots: id, time, reason, files, overlay (oldest first)."""
    return {"snapshots": list_summaries(ctx), "state": read_json(ctx.path("state.json"))}


# ---------------------------------------------------------------- prune


def prune(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Remove all but the newest `keep` snapshots, and the objects no kept snapshot uses.

    + keep (>= 1); dry_run: say what would go, remove nothing.
    Never removed: the deployed state's rollback target and base, and the base of the overlay each
    kept snapshot recorded (a push on top of a restored snapshot reads its reverts from that base).
    Manifests go first, objects last (`ObjectStore.prune`: loose ones, packs, a killed run's leftovers),
    so a kill midway leaves only unused objects, which the next prune removes.
    """
    keep = args.get("keep")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise HelperFailure("bad_request", "keep must be an integer >= 1, got %r" % (keep,),
                            "pass --keep N with N >= 1")
    ctx.ensure_state_dir()
    refuse_if_busy(ctx)
    summaries = list_summaries(ctx)
    state = read_json(ctx.path("state.json")) or {}
    kept = ids_of([s["id"] for s in summaries[-keep:]] + [state.get("snapshot"), base_of(state)])
    manifests = {i: read_json(manifest_path(ctx, i)) or {} for i in kept}
    kept |= ids_of([base_of(m.get("state")) for m in manifests.values()])
    manifests.update({i: read_json(manifest_path(ctx, i)) or {} for i in kept - set(manifests)})
    dropped = [s["id"] for s in summaries if s["id"] not in kept]
    dry_run = bool(args.get("dry_run"))
    if not dry_run:
        for snap_id in dropped:
            remove_quietly(manifest_path(ctx, snap_id))
        rewrite_index(ctx, [s for s in summaries if s["id"] in kept])
    removed, freed = ObjectStore(ctx, pause_point).prune(used_objects(manifests.values(), state), dry_run)
    if not dry_run:
        append_history(ctx, {"op": "prune", "removed": dropped, "objects": removed, "bytes": freed,
                             "by": ctx.owner})
    return {"kept": [s["id"] for s in summaries if s["id"] in kept], "removed": dropped,
            "objects_removed": removed, "bytes_freed": freed, "dry_run": dry_run}


def base_of(state: Optional[Dict[str, Any]]) -> Optional[str]:
    """The pristine snapshot a deployed overlay's plans read from (none when nothing is deployed)."""
    return state.get("base_snapshot") if state and state.get("overlay") else None


def ids_of(values: List[Any]) -> Set[str]:
    return {v for v in values if isinstance(v, str) and v}


def used_objects(manifests: Iterable[Dict[str, Any]], state: Dict[str, Any]) -> Set[str]:
    """Every content a kept manifest records, and the deployed overlay's post-images."""
    used = {e["sha256"] for m in manifests for e in (m.get("files") or {}).values() if "sha256" in e}
    used |= {e["sha256"] for e in (state.get("files") or {}).values() if e and "sha256" in e}
    return used


def rewrite_index(ctx: Context, summaries: List[Dict[str, Any]]) -> None:
    lines = "".join(json.dumps(s, sort_keys=True) + "\n" for s in summaries)
    atomic_write(ctx.path("snapshots", "index.jsonl"), lines.encode())


# ---------------------------------------------------------------- read_files


def read_files(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Hash, mode, size of `paths` (base64 bytes of `want_content`): now, and as `snapshot` recorded them."""
    want = set(args.get("want_content") or [])
    manifest = load_manifest(ctx, args["snapshot"]) if args.get("snapshot") else None
    objects = ObjectStore(ctx)
    out: Dict[str, Any] = {}
    for rel in args.get("paths") or []:
        full = checked_path(ctx, rel)
        info = describe(full, rel in want)
        if manifest is not None:
            info["base"] = describe_recorded(objects, manifest["files"].get(rel), rel in want)
        out[rel] = info
    return {"files": out, "package_root": ctx.package_root}


def describe(full: str, with_content: bool) -> Dict[str, Any]:
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return {"exists": False}
    if stat.S_ISLNK(st.st_mode):
        return {"exists": True, "symlink": os.readlink(full), "mode": stat.S_IMODE(st.st_mode)}
    if not stat.S_ISREG(st.st_mode):
        return {"exists": True, "not_a_file": True, "mode": stat.S_IMODE(st.st_mode)}
    with open(full, "rb") as f:
        data = f.read()
    info = {
        "exists": True,
        "sha256": hashlib.sha256(data).hexdigest(),
        "mode": stat.S_IMODE(st.st_mode),
        "size": len(data),
    }
    if with_content:
        info["content"] = base64.b64encode(data).decode()
    return info


def describe_recorded(objects: ObjectStore, entry: Optional[Entry], with_content: bool) -> Dict[str, Any]:
    if entry is None:
        return {"exists": False}
    info = dict(entry, exists=True)
    if with_content and "link" not in entry:
        info["content"] = base64.b64encode(objects.read(entry["sha256"])).decode()
    return info


# ---------------------------------------------------------------- apply


def apply(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Apply a plan as one journaled transaction.

    + changes: [{path, action: write|create|delete, expect: sha256 now on the host or null,
      sha256: post-image or null, mode, content: base64}]
    + state: {overlay, version, digest, snapshot (rollback target), base_snapshot, files}
    """
    ctx.ensure_state_dir()
    refuse_if_busy(ctx)
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
    write_json(ctx.path("state.json"), dict(new_state, applied=time.time()))
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
        ensure_preimage_objects(ctx, changes, targets)
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


def ensure_preimage_objects(ctx: Context, changes: List[Dict[str, Any]], targets: List[str]) -> None:
    """The bytes a rollback needs are in the store before anything is replaced (normally already there)."""
    objects = ObjectStore(ctx)
    sources = [(full, change["expect"]) for change, full in zip(changes, targets) if change.get("expect")]
    objects.add(objects.from_files(sources, {}))


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
    are restored, and the result is re-hashed. An open journal is closed by this op only.
    """
    ctx.ensure_state_dir()
    journal = read_json(ctx.path("journal.json"))
    state = read_json(ctx.path("state.json")) or {}
    target = args.get("snapshot") or (journal or {}).get("snapshot") or state.get("snapshot")
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
    write_journal(ctx, dict(opened, interrupted=journal), "restore")
    pause_point("restore_journal_written")
    temps = stage_restore(ctx, manifest, todo, journal)
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
            "closed_journal": journal is not None,
            "by": ctx.owner,
        },
    )
    os.unlink(ctx.path("journal.json"))
    fsync_dir(ctx.state_dir)
    return {
        "snapshot": target,
        "restored": todo["write"],
        "removed": todo["remove"],
        "modes": todo["chmod"],
        "verified": len(manifest["files"]),
        "closed_journal": journal,
    }


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
    ctx: Context, manifest: Dict[str, Any], todo: Dict[str, List[str]], journal: Optional[Dict[str, Any]]
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
        if journal is None:
            remove_quietly(ctx.path("journal.json"))
        else:
            write_json(ctx.path("journal.json"), journal)  # the interrupted push stays reported as before
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


def path_entry(full: str, sha_of: Callable[[str, os.stat_result], str]) -> Optional[Entry]:
    """One path's manifest entry as it is now; None if it is absent (or not a file or symlink)."""
    st = lstat_or_none(full)
    return entry_of(full, st, sha_of) if st is not None else None


def lstat_or_none(path: str) -> Optional[os.stat_result]:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------- verify (drift)


def verify(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Installed files versus what state.json says should be there (base snapshot + overlay post-images).

    + deep: re-hash every file; overlay_only: check only the deployed overlay's own files (what
      `status` asks: a few files, no walk of the package).
    """
    state = read_json(ctx.path("state.json")) or {}
    if not state.get("base_snapshot"):
        state = {}  # nothing was ever deployed or restored: nothing to compare against
    if args.get("overlay_only"):
        expected, current, checked = compared_overlay(ctx, state)
    else:
        expected, current, checked = compared_package(ctx, state, bool(args.get("deep")))
    drift = [
        d
        for d in (
            compare(rel, expected.get(rel), current.get(rel)) for rel in sorted(set(expected) | set(current))
        )
        if d
    ]
    return {
        "baseline": state.get("base_snapshot"),
        "overlay": overlay_label(state),
        "clean": not drift,
        "files": drift,
        "checked": checked,
        "journal": read_json(ctx.path("journal.json")),
    }


Compared = Tuple[Dict[str, Optional[Entry]], Dict[str, Entry], int]  # expected, found, how many paths were read


def compared_package(ctx: Context, state: Dict[str, Any], deep: bool) -> Compared:
    """Every file of the package, against the base snapshot with the overlay's post-images over it."""
    if not state:
        return {}, {}, 0
    expected: Dict[str, Optional[Entry]] = dict(load_manifest(ctx, state["base_snapshot"])["files"])
    for rel, post in (state.get("files") or {}).items():
        if post is None:
            expected.pop(rel, None)
        else:
            expected[rel] = post
    cache = StatCache(ctx)
    current, _ = scan(ctx, cache, rehash=tuple(expected) if deep else ())
    if os.path.isdir(ctx.path("snapshots")):
        cache.save(ctx)
    return expected, current, len(current)


def compared_overlay(ctx: Context, state: Dict[str, Any]) -> Compared:
    """The deployed overlay's own files alone (none when nothing is deployed), each re-hashed."""
    expected: Dict[str, Optional[Entry]] = (state.get("files") or {}) if state.get("overlay") else {}
    current = {}
    for rel in expected:
        found = path_entry(checked_path(ctx, rel), sha_of_file)
        if found is not None:
            current[rel] = found
    return expected, current, len(expected)


def compare(rel: str, want: Optional[Entry], have: Optional[Entry]) -> Optional[Dict[str, Any]]:
    if want == have or (
        want and have and want["sha256"] == have["sha256"] and want.get("mode") in (None, have["mode"])
    ):
        return None
    if want is None:
        kind = "added"
    elif have is None:
        kind = "missing"
    elif want["sha256"] != have["sha256"]:
        kind = "modified"
    else:
        kind = "mode"
    return {"path": rel, "kind": kind, "expected": brief(want), "actual": brief(have)}


def brief(entry: Optional[Entry]) -> Optional[Dict[str, Any]]:
    return None if entry is None else {"sha256": entry["sha256"], "mode": entry.get("mode")}


OPS = {
    "snapshot": snapshot,
    "snapshots": snapshots,
    "read_files": read_files,
    "apply": apply,
    "restore": restore,
    "verify": verify,
    "prune": prune,
}
