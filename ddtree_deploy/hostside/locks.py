"""The host lock and the `state` op: who holds the host, what is deployed, whether a journal is open.

`refuse_if_busy` is what every change asks first: no open (or damaged) journal, and the lock held by the caller
(`require_lock`, which `restore` asks alone, as the op that closes journals, and so do the server's start and
stop and `record_launch`: a restart under an open journal is part of its recovery).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

from .common import (
    RECORDS,
    Context,
    HelperFailure,
    append_history,
    read_json,
    read_record,
    read_record_or_damage,
    remove_quietly,
    staged_file,
    write_json,
)


def lock(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Take the lock for `owner` until `ttl_s` from now; a live lock of someone else is refused."""
    ctx.ensure_state_dir()
    owner = str(args["owner"])
    now = time.time()
    record = {"owner": owner, "started": now, "expires": now + float(args.get("ttl_s", 3600)),
              "controller": args.get("controller")}
    path = ctx.path("lock")
    try:
        create_whole(path, json.dumps(record).encode())
    except FileExistsError:
        held = read_lock(ctx) or {}
        stale = args.get("take_over") is not None and held.get("owner") == args.get("take_over")
        if held.get("owner") != owner and held.get("expires", 0) > now and not stale:
            raise HelperFailure(
                "locked", "host is locked by %s since %s" % (held.get("owner"), _iso(held.get("started"))),
                "wait for that operation to finish, or `ddtree-deploy unlock --force` if it is dead",
                holder=held) from None
        write_json(path, record)  # ours already, expired, or its controller is known dead: take it over
        if held.get("owner") != owner:
            append_history(ctx, {"op": "lock", "took_over": held, "by": owner})
        return {"lock": record, "replaced": held}
    return {"lock": record, "replaced": None}


def create_whole(path: str, data: bytes) -> None:
    """Create `path` with `data` in one step (a temp file hard-linked into place), or raise FileExistsError.

    A reader never finds the lock empty or half-written. It is not fsynced: a lock only has to keep
    out live processes, and none survives a power loss; the journal, which is durable, says what a
    crash interrupted.
    """
    tmp, _ = staged_file(os.path.dirname(path), 0o600, lambda out: out.write(data), durable=False)
    try:
        os.link(tmp, path)
    finally:
        remove_quietly(tmp)


def read_lock(ctx: Context) -> Optional[Dict[str, Any]]:
    """The lock record (None: unlocked). One that is not JSON, as a power loss can leave it, counts as expired."""
    try:
        held: Optional[Dict[str, Any]] = read_json(ctx.path("lock"))
        return held
    except ValueError:
        return {"owner": None, "expires": 0, "unreadable": True}


def unlock(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Release the lock if `owner` holds it (or always with `force`); releasing no lock is fine."""
    path = ctx.path("lock")
    held = read_lock(ctx)
    if held is None:
        return {"released": None}
    if held.get("owner") != args.get("owner") and not args.get("force"):
        raise HelperFailure("locked", "lock is held by %s, not by %s" % (held.get("owner"), args.get("owner")),
                            "pass force only if that operation is dead")
    os.unlink(path)
    if args.get("force"):
        append_history(ctx, {"op": "unlock", "forced": True, "was": held, "by": args.get("owner")})
    return {"released": held}


def state(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """What status needs in one round trip: deployed state, lock, open journal, recent history.

    A damaged state.json or journal.json reads as absent and is named under `damaged`, so the
    caller can say which file it is and still show the rest.
    """
    lock_record = read_lock(ctx)
    if lock_record and lock_record.get("expires", 0) <= time.time():
        lock_record = dict(lock_record, expired=True)
    records: Dict[str, Optional[Dict[str, Any]]] = {}
    damaged: List[Dict[str, str]] = []
    for name in RECORDS:
        records[name], damage = read_record_or_damage(ctx, name)
        if damage is not None:
            damaged.append(damage)
    return {
        "state_dir": ctx.state_dir,
        "package_root": ctx.package_root,
        "deployed": records["state.json"],
        "lock": lock_record,
        "journal": records["journal.json"],
        "history": _tail_lines(ctx.path("history.jsonl"), int(args.get("history", 5))),
        "launch": read_json(ctx.path("server", "launch.json")),
        "damaged": damaged,
    }


def refuse_if_busy(ctx: Context, op: str) -> None:
    """What a change asks first: no open journal (interrupted operation, or one too damaged to read), and the
    host lock held by its caller (`require_lock`)."""
    refuse_open_journal(ctx)
    require_lock(ctx, op)


def refuse_open_journal(ctx: Context) -> None:
    journal = read_record(ctx, "journal.json")
    if journal is not None:
        raise HelperFailure(
            "journal_open",
            "an interrupted %s (snapshot %s) left an open journal"
            % (journal.get("op"), journal.get("snapshot")),
            "run `ddtree-deploy rollback --host HOST` to restore snapshot %s" % journal.get("snapshot"),
            journal=journal,
        )


def require_lock(ctx: Context, op: str) -> None:
    """Refuse `op` unless the lock names its caller: a playbook without `preflight` (the step that locks) must not
    race another controller. A lock of ours that expired still counts: expiry only lets another controller take it
    over, and then it names them. Code `locked` while another owner's lock is live, else `not_locked`."""
    held = read_lock(ctx) or {}
    owner = held.get("owner")
    if ctx.owner and owner == ctx.owner:
        return
    if ctx.owner and owner is not None and held.get("expires", 0) > time.time():
        raise HelperFailure(
            "locked", "%s refused: the host is locked by %s since %s" % (op, owner, _iso(held.get("started"))),
            "wait for that operation to finish, or `ddtree-deploy unlock --host HOST --force` if it is dead",
            holder=held)
    raise HelperFailure("not_locked", "%s refused: %s" % (op, _why_not_held(ctx, held)),
                        "lock the host first: begin the playbook with a `preflight` step (it takes the lock)",
                        holder=held or None)


def _why_not_held(ctx: Context, held: Dict[str, Any]) -> str:
    if not ctx.owner:
        return "the request names no owner, so it holds no lock"
    if held.get("unreadable"):
        return "the host lock file cannot be read (it counts as expired)"
    if held.get("owner") is not None:
        return "the host lock of %s expired at %s" % (held["owner"], _iso(held.get("expires")))
    return "nobody holds the host lock"


def record_launch(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Remember how the server was last started (full argv and the overlay's part), for `status`; only for the
    holder of the host lock, who started it."""
    require_lock(ctx, "record_launch")
    ctx.ensure_state_dir()
    record = {"argv": list(args.get("argv") or []), "server_args": list(args.get("server_args") or []),
              "time": time.time(), "by": ctx.owner}
    write_json(ctx.path("server", "launch.json"), record)
    return record


def _tail_lines(path: str, count: int) -> List[Any]:
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()[-count:] if count > 0 else []
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def _iso(ts: Any) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts)) if isinstance(ts, (int, float)) else "?"


OPS = {"lock": lock, "unlock": unlock, "state": state, "record_launch": record_launch}
