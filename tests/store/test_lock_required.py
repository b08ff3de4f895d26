"""Every op that changes the host checks, on the host, that its caller holds the host lock.

A playbook of one's own without a `preflight` step (the step that takes the lock) must not race
another controller: before, `restore` never looked at the lock, and the other ops only refused a
live lock of someone else, so a caller holding no lock at all changed the host.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from store_helpers import folder_listing, make_ctx, plan_in_process, push_in_process, tree_state

from ddtree_deploy.hostside import deployed, locks, store, transactions
from ddtree_deploy.hostside.common import Context, HelperFailure, read_json
from ddtree_deploy.overlay import Overlay


def as_owner(site: Path, tmp_path: Path, owner: str) -> Context:
    return Context({"package_root": str(site), "state_base": str(tmp_path / "state"), "owner": owner})


def changing_requests(ctx: Context, snap: str, next_plan: dict[str, Any]) -> dict[str, tuple[Callable[..., Any], Any]]:
    digest = read_json(ctx.path("state.json"))["digest"]
    return {"snapshot": (store.snapshot, {"reason": "r"}), "apply": (transactions.apply, next_plan),
            "restore": (transactions.restore, {"snapshot": snap}), "prune": (store.prune, {"keep": 1}),
            "mark_verified": (deployed.mark_verified, {"digest": digest}), "adopt": (deployed.adopt, {})}


def test_every_change_is_refused_to_a_caller_without_the_lock_and_changes_nothing(
        site: Path, tmp_path: Path, mini: Callable[[str], Overlay]) -> None:
    ctx = make_ctx(site, tmp_path / "state")
    locks.lock(ctx, {"owner": "tests"})
    _, snap = push_in_process(ctx, mini("0.1.0"))
    requests = changing_requests(ctx, snap, plan_in_process(ctx, mini("0.2.0")).helper_args(snap))
    locks.unlock(ctx, {"owner": "tests"})
    bob, alice = as_owner(site, tmp_path, "bob"), as_owner(site, tmp_path, "alice")
    applied = tree_state(site)
    for holder, code, named in ((None, "not_locked", "nobody holds"), ("alice", "locked", "locked by alice"),
                                ("expired", "not_locked", "expired")):
        if holder == "alice":
            locks.lock(alice, {"owner": "alice", "ttl_s": 600})
        if holder == "expired":
            locks.lock(alice, {"owner": "alice", "ttl_s": 0})
        listing = folder_listing(Path(ctx.state_dir))
        for name, (op, args) in requests.items():
            with pytest.raises(HelperFailure) as err:
                op(bob, args)
            message = err.value.message
            assert err.value.code == code and message.startswith(name + " refused") and named in message, message
            assert "\n" not in message and ("preflight" in err.value.hint or "unlock" in err.value.hint), err.value.hint
        assert tree_state(site) == applied and folder_listing(Path(ctx.state_dir)) == listing, holder
    assert store.prune(bob, {"keep": 1, "dry_run": True})["dry_run"]  # changes nothing: no lock needed


def test_the_lock_holder_may_change_the_host_even_once_its_lock_expired(
        site: Path, tmp_path: Path, mini: Callable[[str], Overlay]) -> None:
    """Expiry lets another controller take a lock over; until one does, it is still the caller's."""
    ctx = make_ctx(site, tmp_path / "state")
    pristine = tree_state(site)
    locks.lock(ctx, {"owner": "tests", "ttl_s": 0})
    _, snap = push_in_process(ctx, mini("0.1.0"))
    assert deployed.mark_verified(ctx, {"digest": read_json(ctx.path("state.json"))["digest"]})["deployed"]["verified"]
    assert transactions.restore(ctx, {"snapshot": snap})["snapshot"] == snap
    assert tree_state(site) == pristine
    nameless = as_owner(site, tmp_path, "")
    locks.lock(nameless, {"owner": ""})
    with pytest.raises(HelperFailure) as err:  # a request naming no owner never holds a lock
        store.snapshot(nameless, {"reason": "r"})
    assert err.value.code == "not_locked" and "no owner" in err.value.message
