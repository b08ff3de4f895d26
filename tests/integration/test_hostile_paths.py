"""Inventory values with spaces, quotes, backticks and `$(...)` never reach a shell unquoted, over SSH or locally."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sshd_fleet import Fleet

from ddtree_deploy.inventory import load_inventory
from ddtree_deploy.transport import transport_for

Cli = Callable[..., Any]


@pytest.fixture
def markers() -> Iterator[list[Path]]:
    """Files that only a shell expanding our paths would create; removed afterwards."""
    tag = uuid.uuid4().hex[:12]
    paths = [Path(f"/tmp/pwned-{tag}-dollar"), Path(f"/tmp/pwned-{tag}-backtick"), Path(f"/tmp/pwned-{tag}-semi")]
    yield paths
    for path in paths:
        path.unlink(missing_ok=True)


def hostile_folder(base: Path, markers: list[Path], style: str = "quotes") -> Path:
    """A folder name a shell would act on. `quotes` also holds quotes (an unquoted shell fails to parse it);
    `expansions` holds only spaces and substitutions, which an unquoted shell would run."""
    dollar, backtick, semi = markers
    if style == "expansions":
        return base / f"my env $(touch {dollar}) `touch {backtick}`"
    return base / f"it's a \"host\" $(touch {dollar}) `touch {backtick}`; touch {semi} #"


@pytest.fixture(params=["quotes", "expansions"])
def hostile_fleet(
    request: pytest.FixtureRequest, fleet_factory: Callable[..., Fleet], tmp_path: Path, markers: list[Path]
) -> Fleet:
    """ct129 whose whole tree (python, package root, state) lives under a hostile folder name."""
    return fleet_factory(("ct129",), host_roots={"ct129": hostile_folder(tmp_path, markers, request.param) / "ct129"})


def test_hostile_paths_over_ssh_work_and_run_nothing(
    hostile_fleet: Fleet, tmp_path: Path, cli: Cli, markers: list[Path]
) -> None:
    host = hostile_fleet.hosts["ct129"]
    inventory = hostile_fleet.write_inventory(hostile_folder(tmp_path, markers) / "inventory dir" / "inventory.yaml")

    out = cli("status", "--json", inventory=inventory)

    assert out.exit_code == 0, out.stdout
    status = out.rows()["ct129"]["result"]
    assert status["sglang"] == "0.5.17" and status["cuda_variant"] == "cu130"
    assert status["package_root"] == str(host.package_root)

    inv = load_inventory(str(inventory))
    transport = transport_for(inv.hosts["ct129"], inv.ssh, owner="o'brien $(id)")
    try:
        locked = transport.call("lock", {"owner": "o'brien $(touch " + str(markers[0]) + ")"})
    finally:
        transport.close()
    assert locked["lock"]["owner"].startswith("o'brien $(touch")
    lock_files = list(host.state_dir.glob("*/lock"))
    assert len(lock_files) == 1  # the state went exactly where the inventory said
    assert [m for m in markers if m.exists()] == []


def test_hostile_paths_over_the_local_transport(
    make_host: Callable[..., Any], tmp_path: Path, markers: list[Path], cli: Cli
) -> None:
    host = make_host("ct200", root=hostile_folder(tmp_path, markers) / "ct200")
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"sbx": host.inventory_entry(transport="local")}}))

    out = cli("status", "--json", inventory=inventory)

    assert out.exit_code == 0, out.stdout
    assert out.rows()["sbx"]["result"]["torch"] == "2.11.0+cu128"
    assert [m for m in markers if m.exists()] == []

