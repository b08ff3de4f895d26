"""A push across two sandbox hosts: a failed canary stops the rollout, and Ctrl-C stops a push safely.

Both run the real CLI as a subprocess on `transport: local` hosts (ct129, ct200) with stand-in
servers, and prove the packages bit-exact afterwards. Ctrl-C is sent as a terminal sends it: to
the whole process group, the local host helpers included (tests/push/interrupt.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.push.conftest import Fleet, started_fleet
from tests.push.interrupt import assert_rolled_back_after_the_step, push_interrupted


@pytest.fixture(scope="module")
def fleet2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from started_fleet(tmp_path_factory.mktemp("fleet2"), ("ct129", "ct200"), ready_timeout_s=60.0)


def _audit(fleet: Fleet) -> dict[str, Any]:
    lines = Path(fleet.env["DDTREE_AUDIT_LOG"]).read_text().splitlines()
    last: dict[str, Any] = json.loads(lines[-1])
    return last


def test_a_failed_canary_stops_the_rollout_and_the_untouched_host_says_why(fleet2: Fleet) -> None:
    before = {host: fleet2.package_digest(host) for host in ("ct129", "ct200")}
    code, envelope = fleet2.json("push", "--all", "--overlay", "broken", "--wave-size", "1", "--max-failures", "0")
    rows = {row["host"]: row for row in envelope["data"]["hosts"]}  # type: ignore[index]
    assert code == 1, envelope
    assert rows["ct129"]["result"]["outcome"] == "rolled_back" and rows["ct129"]["result"]["healthy"] is True
    assert rows["ct200"]["skipped"] is True and rows["ct200"]["result"] is None
    assert rows["ct200"]["skip_reason"] == "not started: wave 1 exceeded --max-failures 0 (ct129 rolled back)"
    assert {host: fleet2.package_digest(host) for host in before} == before
    assert not list(Path(str(fleet2.host_spec("ct200")["state_dir"])).glob("*/snapshots/*.json"))  # never touched
    assert _audit(fleet2)["hosts"] == {"ct129": "rolled_back", "ct200": "skipped"}


def test_ctrl_c_during_a_step_rolls_back_reports_audits_and_exits_130(fleet2: Fleet) -> None:
    before = fleet2.package_digest("ct200")
    data = push_interrupted(fleet2.env, "ct200", Path(str(fleet2.host_spec("ct200")["state_dir"])))
    assert_rolled_back_after_the_step(data, Path(fleet2.env["DDTREE_AUDIT_LOG"]))
    assert fleet2.package_digest("ct200") == before
