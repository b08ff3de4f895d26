"""An applied overlay is unverified until the probes of the push that applied it pass (`mark_verified`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from store_helpers import push_in_process

from ddtree_deploy.hostside import deployed, transactions
from ddtree_deploy.hostside.common import Context, HelperFailure, read_json
from ddtree_deploy.overlay import Overlay


def test_an_apply_is_unverified_until_marked_and_a_restore_keeps_what_its_snapshot_recorded(
        ctx: Context, mini: Callable[[str], Overlay]) -> None:
    first, _ = push_in_process(ctx, mini("0.1.0"))
    assert read_json(ctx.path("state.json"))["verified"] is False
    with pytest.raises(HelperFailure) as err:
        deployed.mark_verified(ctx, {"digest": "0" * 64})
    assert err.value.code == "state_changed" and read_json(ctx.path("state.json"))["verified"] is False
    assert deployed.mark_verified(ctx, {"digest": first.digest})["deployed"]["verified"] is True
    _, on_first = push_in_process(ctx, mini("0.2.0"))  # its snapshot records 0.1.0, verified
    assert read_json(ctx.path("state.json"))["verified"] is False
    transactions.restore(ctx, {"snapshot": on_first})
    state = read_json(ctx.path("state.json"))
    assert (state["version"], state["verified"]) == ("0.1.0", True)
