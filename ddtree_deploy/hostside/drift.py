"""Drift: the installed files compared with what state.json says should be there (the `verify` op).

The expected package is the base snapshot with the deployed overlay's post-images over it; a
quick check (`overlay_only`, what `status` asks) re-hashes only the overlay's own files.
"""

from __future__ import annotations

import base64
import os
from typing import Any, Dict, Optional, Tuple

from .common import Context, read_record
from .objects import ObjectStore
from .package import Entry, StatCache, checked_path, path_entry, scan, sha_of_file
from .store import load_manifest, overlay_label


def verify(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Installed files versus what state.json says should be there (base snapshot + overlay post-images).

    + deep: re-hash every file; overlay_only: check only the deployed overlay's own files (what
      `status` asks: a few files, no walk of the package); content: add each drifted file's bytes,
      as expected (from the store) and as installed, base64 (`diff --content`).
    """
    state = read_record(ctx, "state.json") or {}
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
    if args.get("content"):
        objects = ObjectStore(ctx)
        for d in drift:
            d.update(contents(ctx, objects, d["path"], expected.get(d["path"]), current.get(d["path"])))
    return {
        "baseline": state.get("base_snapshot"),
        "overlay": overlay_label(state),
        "clean": not drift,
        "files": drift,
        "checked": checked,
        "journal": read_record(ctx, "journal.json"),
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


MAX_CONTENT = 1 << 20  # a drifted file larger than this is named, not shown


def contents(
    ctx: Context, objects: ObjectStore, rel: str, want: Optional[Entry], have: Optional[Entry]
) -> Dict[str, Any]:
    """The two sides of a drifted file, base64 (None: absent, or `content_note` says why it is not shown)."""
    notes = []
    sides: Dict[str, Any] = {"expected_content": None, "actual_content": None}
    for key, entry in (("expected_content", want), ("actual_content", have)):
        if entry is None:
            continue
        if "link" in entry or entry.get("size", 0) > MAX_CONTENT:
            notes.append("%s: %s" % (key.split("_")[0], "a symlink" if "link" in entry else "over 1 MB"))
        elif key == "actual_content":
            with open(checked_path(ctx, rel), "rb") as f:
                sides[key] = base64.b64encode(f.read()).decode()
        elif objects.has(entry["sha256"]):
            sides[key] = base64.b64encode(objects.read(entry["sha256"])).decode()
        else:
            notes.append("expected: contents not in the store")
    return dict(sides, content_note="; ".join(notes))


def brief(entry: Optional[Entry]) -> Optional[Dict[str, Any]]:
    return None if entry is None else {"sha256": entry["sha256"], "mode": entry.get("mode")}


OPS = {"verify": verify}
