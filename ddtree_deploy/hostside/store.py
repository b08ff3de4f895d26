"""The host's content-addressed store of snapshots: taking them, listing them, reading file facts, pruning.

Ops: `snapshot`, `snapshots`, `read_files`, `prune`. State layout under ctx.state_dir:

    objects/                  file contents by sha256, loose or packed (objects.py owns them)
    snapshots/<id>.json       manifest: files {path: {sha256, mode, size} or {link}}, dirs, state, ...
    snapshots/index.jsonl     one summary line per snapshot (so listing never parses manifests)
    snapshots/statcache.json  the scan's stat cache (package.py)
    state.json                what is deployed: overlay, version, digest, snapshot, base_snapshot,
                              files {path: {sha256, mode} or null} (the overlay's post-images)

A snapshot copies only contents the store lacks, and undoes what it added if anything fails, so
the store stays as it was. Changes to the package itself are transactions.py's; drift is drift.py's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import stat
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from .common import (
    Context,
    HelperFailure,
    append_history,
    atomic_write,
    os_failure,
    pause_point,
    read_json,
    read_record,
    read_record_or_damage,
    remove_quietly,
)
from .locks import refuse_if_busy, refuse_open_journal, require_lock
from .objects import Added, Collector, ObjectStore
from .package import RACY_NS, Entry, StatCache, checked_path, scan

# ---------------------------------------------------------------- manifests


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


# ---------------------------------------------------------------- snapshot


def snapshot(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Record every file of the package into the store; only new contents are copied.

    + reason: why (e.g. "pre-push"); fingerprint: the host's fingerprint, kept verbatim;
      overlay: what is deployed (default: state.json's record).
    """
    refuse_if_busy(ctx, "snapshot")
    ctx.ensure_state_dir()
    state = read_record(ctx, "state.json")  # what the manifest records as deployed: unreadable, no snapshot
    return take_snapshot(ctx, str(args.get("reason") or ""), args.get("fingerprint"), state,
                         args.get("overlay") or overlay_label(state))


#: what a snapshot records, given the package as scanned: (files, dirs)
Amend = Callable[[Dict[str, Entry], Dict[str, int]], Tuple[Dict[str, Entry], Dict[str, int]]]


def take_snapshot(ctx: Context, reason: str, fingerprint: Any, state: Optional[Dict[str, Any]],
                  overlay: Optional[str], amend: Optional[Amend] = None) -> Dict[str, Any]:
    """Scan the package, store the contents the store lacks and write the manifest (`amend` may change which
    files it records, from the scan and contents already stored); undone completely if anything fails."""
    started = time.time()
    cache = StatCache(ctx)
    objects = ObjectStore(ctx, pause_point)
    collector = Collector(objects, cache.started_ns - RACY_NS)
    added = Added()
    try:
        files, dirs = scan(ctx, cache, read=collector.hash)  # a first snapshot's pack fills as it goes
        sources = [(ctx.package_root + "/" + rel, e["sha256"]) for rel, e in files.items() if "link" not in e]
        added = collector.store_rest(sources)
        if amend is not None:
            files, dirs = amend(files, dirs)
        digest = files_digest(files)
        snap_id = (
            time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
            + "-"
            + hashlib.sha256(("%s%d" % (digest, time.time_ns())).encode()).hexdigest()[:8]
        )
        manifest = {
            "id": snap_id,
            "time": started,
            "reason": reason,
            "fingerprint": fingerprint,
            "package_root": ctx.package_root,
            "overlay": overlay,
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
    append_history(ctx, {"op": "snapshot", "id": snap_id, "reason": reason, "by": ctx.owner})
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
    """List snapshots: id, time, reason, files, overlay (oldest first); a damaged state.json reads as none
    (the listing is what `rollback --to` needs then)."""
    return {"snapshots": list_summaries(ctx), "state": read_record_or_damage(ctx, "state.json")[0]}


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
    dry_run = bool(args.get("dry_run"))
    refuse_open_journal(ctx)
    if not dry_run:  # a dry run changes nothing: `prune --dry-run` takes no lock
        require_lock(ctx, "prune")
    ctx.ensure_state_dir()
    summaries = list_summaries(ctx)
    state = read_record(ctx, "state.json") or {}  # damaged: the rollback target is unknown, so nothing goes
    kept = ids_of([s["id"] for s in summaries[-keep:]] + [state.get("snapshot"), base_of(state)])
    manifests = {i: read_json(manifest_path(ctx, i)) or {} for i in kept}
    # A kept snapshot restored brings back its recorded state: the base and the rollback target it names
    # must still be there, or that state would point at nothing.
    kept |= ids_of([x for m in manifests.values() for x in (base_of(m.get("state")), rollback_target(m.get("state")))])
    manifests.update({i: read_json(manifest_path(ctx, i)) or {} for i in kept - set(manifests)})
    dropped = [s["id"] for s in summaries if s["id"] not in kept]
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


def rollback_target(state: Optional[Dict[str, Any]]) -> Optional[str]:
    """The snapshot a recorded deployment rolls back to (none when nothing is deployed)."""
    return state.get("snapshot") if state and state.get("overlay") else None


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


OPS = {"snapshot": snapshot, "snapshots": snapshots, "read_files": read_files, "prune": prune}
