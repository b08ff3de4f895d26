"""Crash safety: SIGKILL the controller (and its helper) at named points of a push or a rollback.

Every kill must leave an open journal that later commands report and refuse on, and a rollback
must then restore the pre-push package bit-exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import OVERLAYS, local_transport, run_and_kill, tree_state

from ddtree_deploy.catalog import load_overlay
from ddtree_deploy.errors import HelperError
from ddtree_deploy.plan import Plan
from ddtree_deploy.remote import drift, locks, store, transactions
from ddtree_deploy.steps import plan_for_host
from ddtree_deploy.transport import LocalTransport

# mini@0.1.0 writes 3 files: server_args.py, spec_info.py (patched), mini_utils.py (created)
APPLY_POINTS = ["journal_written", "file_staged:1", "file_written:1", "file_written:3", "state_written"]


def push(t: LocalTransport) -> None:
    """The controller's side of a push (files only): plan, snapshot, journaled apply."""
    plan = plan_for_host(t, load_overlay("mini@0.1.0", OVERLAYS), "0.5.17", deployed=locks.state(t).deployed)
    transactions.apply(t, plan.helper_args(store.snapshot(t, "pre-push").id))


def assert_refused_until_rollback(t: LocalTransport, site: Path, before: dict[str, object], plan: Plan) -> None:
    journal = t.call("state")["journal"]
    assert journal is not None
    assert drift.verify(t).journal_open
    for refused in (lambda: store.snapshot(t, "after crash"),
                    lambda: transactions.apply(t, plan.helper_args(journal["snapshot"]))):
        with pytest.raises(HelperError) as err:
            refused()
        assert err.value.code == "journal_open" and journal["snapshot"] in err.value.hint
    result = transactions.restore(t)
    assert result.closed_journal and result.snapshot == journal["snapshot"]
    assert tree_state(site) == before
    assert t.call("state")["journal"] is None
    assert drift.verify(t).clean


@pytest.mark.parametrize("point", APPLY_POINTS)
def test_push_killed_at_any_point_leaves_a_journal_and_rollback_restores_bit_exact(
        point: str, site: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    t = local_transport(site, state)
    before = tree_state(site)
    plan = plan_for_host(t, load_overlay("mini@0.1.0", OVERLAYS), "0.5.17")
    run_and_kill(lambda: push(t), point, tmp_path)
    assert_refused_until_rollback(t, site, before, plan)


@pytest.mark.parametrize("point", ["restore_journal_written", "restore_file_written:1"])
def test_rollback_killed_half_way_is_finished_by_the_next_rollback(point: str, site: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    t = local_transport(site, state)
    before = tree_state(site)
    plan = plan_for_host(t, load_overlay("mini@0.1.0", OVERLAYS), "0.5.17")
    push(t)
    assert tree_state(site) != before
    run_and_kill(lambda: transactions.restore(t), point, tmp_path)
    assert_refused_until_rollback(t, site, before, plan)
