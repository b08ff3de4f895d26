"""The wire contract: the op names match the helper's tables, answers are read typed, a wrong shape is named."""

from __future__ import annotations

import importlib
import pkgutil
from typing import get_args

import pytest

from ddtree_deploy import hostside
from ddtree_deploy.errors import HelperError
from ddtree_deploy.protocol import HelperResult, HostState, Op


def _helper_ops() -> set[str]:
    ops: set[str] = set()
    for module in pkgutil.iter_modules(hostside.__path__):
        if module.name != "bootstrap":
            ops |= set(getattr(importlib.import_module(f"ddtree_deploy.hostside.{module.name}"), "OPS", {}))
    return ops


def test_the_op_literal_names_exactly_the_helpers_ops() -> None:
    assert set(get_args(Op)) == _helper_ops()


def _answered(data: object) -> HelperResult:
    return HelperResult(host="ct200", op="state", exit_code=0, answer={"ok": True, "data": data})


def test_a_state_answer_is_read_typed() -> None:
    state = _answered({
        "state_dir": "/s", "package_root": "/site",
        "deployed": {"overlay": "ddtree", "version": "0.2.2", "snapshot": "s1", "base_snapshot": "s0",
                     "files": {}, "applied": 1.0},
        "lock": {"owner": "alice", "started": 1.0, "expires": 2.0, "controller": {"host": "ws", "pid": 7},
                 "expired": True},
        "journal": {"op": "restore", "snapshot": "s1", "paths": ["sglang/a.py"],
                    "interrupted": {"op": "apply", "snapshot": "s1"}},
        "history": [{"op": "apply"}], "launch": {"argv": ["python3"], "server_args": ["--x"]},
    }).parsed(HostState)
    assert state.deployed is not None and state.deployed.label == "ddtree@0.2.2"
    assert state.lock is not None and state.lock.expired and state.lock.controller is not None
    assert state.lock.controller.pid == 7
    assert state.journal is not None and state.journal.interrupted is not None
    assert state.journal.interrupted.op == "apply"
    assert state.launch is not None and state.launch.server_args == ["--x"]


def test_an_answer_of_another_shape_is_a_helper_error_naming_op_and_field() -> None:
    with pytest.raises(HelperError) as info:
        _answered({"state_dir": "/s", "package_root": "/site", "lock": {"expires": "soon"}}).parsed(HostState)
    assert info.value.code == "bad_answer" and info.value.host == "ct200"
    assert "helper op state answered unexpectedly: lock.expires" in str(info.value)


def test_a_refusal_keeps_its_code() -> None:
    refused = HelperResult(host="h", op="lock", exit_code=0,
                           answer={"ok": False, "error": {"code": "locked", "message": "held"}})
    assert refused.refusal == "locked" and _answered({}).refusal is None
    with pytest.raises(HelperError, match="held"):
        refused.parsed(HostState)


def test_every_helper_module_is_shipped_to_the_host() -> None:
    from ddtree_deploy.transport import hostside_modules

    shipped = set(hostside_modules())
    assert shipped == {m.name for m in pkgutil.iter_modules(hostside.__path__)} - {"bootstrap"}
    assert {"package", "store", "transactions", "drift"} <= shipped
