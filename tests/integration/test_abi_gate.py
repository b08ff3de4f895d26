"""The ABI gate on the two sshd test hosts: push preflight refuses what would not import, and says why.

Every refusal leaves the host's package and state exactly as they were.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from conftest import CliOutcome
    from sshd_fleet import Fleet

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def tree_digest(root: Path) -> str:
    """Every file under `root`: path, mode and bytes."""
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(folder, name)
            h.update(f"{path.relative_to(root)}\0{path.lstat().st_mode}\0".encode() + path.read_bytes())
    return h.hexdigest()


@pytest.fixture
def overlays(tmp_path: Path) -> Path:
    folder = tmp_path / "overlays"
    folder.mkdir()
    for source in [*(HERE / "overlays").iterdir(), REPO / "tests" / "store" / "overlays" / "mini"]:
        (folder / source.name).symlink_to(source)
    return folder


@pytest.fixture
def gate(fresh_fleet: Fleet, tmp_path: Path, overlays: Path, cli: Callable[..., CliOutcome]) -> Callable[..., CliOutcome]:
    """`gate(*args)`: the CLI against a fresh ct129+ct200 fleet over ssh, each host's nvidia-smi stand-in on PATH."""
    extra = {name: {"env": {"PATH": f"{h.bin_dir}:/usr/bin:/bin"}} for name, h in fresh_fleet.hosts.items()}
    inventory = fresh_fleet.write_inventory(tmp_path / "inventory.yaml", hosts=extra)
    def run(*args: str) -> CliOutcome:
        with_overlays = ["--overlays", str(overlays)] if args[0] in ("push", "rollback") else []
        return cli(*args, "--inventory", str(inventory), *with_overlays, "--json")

    return run


def reinstall_torch_as_cu128(site: Path) -> None:
    """What `pip install torch==2.11.0+cu128` over a cu130 build leaves: new version.py and dist-info."""
    version_py = site / "torch" / "version.py"
    version_py.write_text(version_py.read_text().replace("13.0", "12.8").replace("+cu130", "+cu128"))
    metadata = next(site.glob("torch-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("+cu130", "+cu128"))


def digests(fleet: Fleet) -> dict[str, str]:
    return {name: tree_digest(host.root) for name, host in fleet.hosts.items()}


def outcome(result: CliOutcome, host: str) -> dict[str, Any]:
    row = result.rows()[host]
    assert row["result"] is not None, row
    return row["result"]


def test_an_overlay_for_cu130_is_refused_on_the_cu128_host_naming_both(fresh_fleet: Fleet, gate: Callable[..., CliOutcome]) -> None:
    ct200_before = tree_digest(fresh_fleet.hosts["ct200"].root)
    result = gate("push", "--all", "--overlay", "needs-cu130")
    assert result.exit_code == 1
    assert outcome(result, "ct129")["outcome"] == "ok"
    refused = outcome(result, "ct200")
    assert refused["outcome"] == "refused" and refused["failed_step"] == "preflight"
    assert "cu130" in refused["reason"] and "cu128" in refused["reason"]
    assert tree_digest(fresh_fleet.hosts["ct200"].root) == ct200_before


def test_a_kernel_pinned_to_another_torch_is_caught(fresh_fleet: Fleet, gate: Callable[..., CliOutcome]) -> None:
    host = fresh_fleet.hosts["ct200"]
    metadata = next(host.package_root.glob("sglang_kernel-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("torch==2.11.0", "torch==2.10.0"))
    before = digests(fresh_fleet)
    result = gate("push", "--host", "ct200", "--overlay", "mini@0.1.0")
    refused = outcome(result, "ct200")
    assert result.exit_code == 1 and refused["outcome"] == "refused"
    assert "sglang-kernel" in refused["reason"] and "2.10.0" in refused["reason"]
    assert gate("abi", "--host", "ct200").exit_code == 1
    assert digests(fresh_fleet) == before


def test_a_driver_too_old_for_cu130_is_caught(fresh_fleet: Fleet, gate: Callable[..., CliOutcome]) -> None:
    smi = fresh_fleet.hosts["ct129"].bin_dir / "nvidia-smi"
    smi.write_text(smi.read_text().replace("580.95.05", "570.86.10"))
    before = digests(fresh_fleet)
    result = gate("push", "--host", "ct129", "--overlay", "mini@0.1.0")
    refused = outcome(result, "ct129")
    assert result.exit_code == 1 and refused["outcome"] == "refused"
    assert "driver" in refused["reason"] and "570.86.10" in refused["reason"]
    assert digests(fresh_fleet) == before


def test_a_python_outside_the_overlay_range_is_refused(fresh_fleet: Fleet, gate: Callable[..., CliOutcome]) -> None:
    before = digests(fresh_fleet)
    result = gate("push", "--host", "ct129", "--overlay", "needs-py313")
    refused = outcome(result, "ct129")
    assert result.exit_code == 1 and refused["outcome"] == "refused"
    assert "python" in refused["reason"] and ">=3.13" in refused["reason"]
    assert digests(fresh_fleet) == before


def test_rollback_across_a_changed_fingerprint_needs_force(fresh_fleet: Fleet, gate: Callable[..., CliOutcome]) -> None:
    host = fresh_fleet.hosts["ct129"]
    pristine = tree_digest(host.package_root / "sglang")
    assert outcome(gate("push", "--host", "ct129", "--overlay", "mini@0.1.0"), "ct129")["outcome"] == "ok"
    reinstall_torch_as_cu128(host.package_root)
    before = digests(fresh_fleet)
    refused = gate("rollback", "--host", "ct129")
    result = outcome(refused, "ct129")
    assert refused.exit_code == 1 and result["outcome"] == "refused", result
    assert "cu128" in result["reason"] and "cu130" in result["reason"], result["reason"]
    assert digests(fresh_fleet) == before
    forced = gate("rollback", "--host", "ct129", "--force")
    assert forced.exit_code == 0 and outcome(forced, "ct129")["outcome"] == "ok", forced.stdout
    assert tree_digest(host.package_root / "sglang") == pristine
