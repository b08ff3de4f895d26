"""A sandbox host (ct200: real sglang 0.5.17 files, stand-in server) with the ddtree overlay pushed, for `bench`.

The stand-in's service args carry two test switches that only some budgets trip: DDTREE above
budget 300 dies at start-up, and DDTREE at 128 or more answers unlike the plain server (see
sandbox/standin_server.py), so the failure tests pick their budget and the others stay below both.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.push.conftest import Fleet, started_fleet

MAX_BUDGET, LOSSY_FROM = 300, 128


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("bench-fleet")
    fleets = started_fleet(root, ("ct200",), ready_timeout_s=20.0, extra_args=[
        "--standin-max-ddtree-budget", str(MAX_BUDGET), "--standin-lossy-from-budget", str(LOSSY_FROM)])
    the_fleet = next(fleets)
    pushed = the_fleet.cli("push", "--host", "ct200")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    yield the_fleet
    next(fleets, None)


def status_row(fleet: Fleet) -> dict[str, Any]:
    code, envelope = fleet.json("status", "--host", "ct200")
    row: dict[str, Any] = envelope["data"]["hosts"][0]["result"]  # type: ignore[index]
    assert row["server"].startswith("healthy"), row
    return row


def host_report(envelope: dict[str, Any]) -> dict[str, Any]:
    rows = envelope["data"]["report"]["hosts"]
    assert len(rows) == 1
    result: dict[str, Any] = rows[0]["result"]
    return result


def bench_json(folder: Path) -> dict[str, Any]:
    value: dict[str, Any] = json.loads((folder / "bench.json").read_text())
    return value


def service_args(inventory: Path) -> list[str]:
    args: list[str] = yaml.safe_load(inventory.read_text())["hosts"]["ct200"]["service"]["args"]
    return args
