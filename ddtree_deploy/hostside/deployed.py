"""state.json amended in place: the deployed overlay marked verified, the installed files adopted as the baseline.

Ops: `mark_verified`, `adopt`. Neither changes a file of the package. An apply records its overlay
as unverified (transactions.py); the push's probe step marks it verified once every probe passed.
`adopt` is how drift the operator has looked at stops being drift: the package as installed becomes
what `verify` compares against, through a snapshot (reason "adopt") that is also the new rollback target.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Set, Tuple

from .common import Context, HelperFailure, append_history, read_record, write_json
from .drift import brief
from .locks import refuse_if_busy
from .package import Entry
from .store import load_manifest, overlay_label, take_snapshot


def mark_verified(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Record that the deployed overlay's probes passed.

    + digest: the digest of the overlay the probes ran against; refused (state_changed) when
      state.json records another one now.
    """
    refuse_if_busy(ctx, "mark_verified")
    state = read_record(ctx, "state.json") or {}
    if not state.get("overlay") or state.get("digest") != args.get("digest"):
        raise HelperFailure("state_changed",
                            "the deployed overlay is %s, not the one that was probed" % (overlay_label(state) or "none"),
                            "another operation changed the host meanwhile; see `ddtree-deploy status`")
    verified = dict(state, verified=True, verified_at=time.time())
    write_json(ctx.path("state.json"), verified)
    append_history(ctx, {"op": "verified", "overlay": overlay_label(state), "by": ctx.owner})
    return {"deployed": verified}


def adopt(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Make the package as installed the baseline that drift is measured against; no package file changes.

    + fingerprint: the host's, kept in the snapshot.
    The snapshot (reason "adopt") records the package the deployed overlay sits on: the installed
    files, with the overlay's own paths as its base snapshot recorded them (so plans still patch
    pristine bytes, and a rollback takes the overlay off and keeps what was adopted); the overlay's
    own files as installed become its post-images. With nothing deployed it records the package as
    installed. The snapshot becomes both the rollback target and the base.
    """
    refuse_if_busy(ctx, "adopt")
    ctx.ensure_state_dir()
    state = read_record(ctx, "state.json") or {}
    owned = sorted(state.get("files") or {}) if state.get("overlay") else []
    base = load_manifest(ctx, str(state.get("base_snapshot") or "")) if owned else None
    installed: Dict[str, Optional[Entry]] = {}

    def without_overlay(files: Dict[str, Entry], dirs: Dict[str, int]) -> Tuple[Dict[str, Entry], Dict[str, int]]:
        installed.update((rel, files.get(rel)) for rel in owned)
        if base is None:
            return files, dirs
        return base_files(files, dirs, base, owned)

    taken = take_snapshot(ctx, "adopt", args.get("fingerprint"), None, None, without_overlay)
    adopted = dict(state, snapshot=taken["id"], base_snapshot=taken["id"], adopted=time.time())
    if owned:
        adopted["files"] = {rel: brief(installed.get(rel)) for rel in owned}
    elif not state.get("overlay"):  # an overlay that owns no file (say server.args only) stays recorded
        adopted.update(overlay=None, version=None, digest=None, files={})
    write_json(ctx.path("state.json"), adopted)
    append_history(ctx, {"op": "adopt", "snapshot": taken["id"], "overlay": overlay_label(state), "by": ctx.owner})
    return {"snapshot": taken, "deployed": adopted}


def base_files(files: Dict[str, Entry], dirs: Dict[str, int], base: Dict[str, Any],
               owned: List[str]) -> Tuple[Dict[str, Entry], Dict[str, int]]:
    """The installed files with each of the overlay's own paths as `base` recorded it (absent if it had none),
    and the folders that `base` had or that still hold a file."""
    kept = dict(files)
    for rel in owned:
        recorded = base["files"].get(rel)
        if recorded is None:
            kept.pop(rel, None)
        else:
            kept[rel] = recorded
    holding: Set[str] = set()
    for rel in kept:
        parts = rel.split("/")[:-1]
        holding.update("/".join(parts[:n]) for n in range(1, len(parts) + 1))
    return kept, {d: mode for d, mode in dirs.items() if d in base["dirs"] or d in holding}


OPS = {"mark_verified": mark_verified, "adopt": adopt}
