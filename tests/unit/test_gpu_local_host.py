"""tools/gpu/local_host.sh: the inventory the GPU scripts write for a `transport: local` host loads in
the tool, with and without extra server args (a hybrid target's --max-running-requests)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ddtree_deploy.inventory import load_inventory

SCRIPT = Path(__file__).resolve().parents[2] / "tools/gpu/local_host.sh"


def written(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "inventory.yaml"
    call = ['. "$0"; local_host_inventory "$1" /models/hyb_copy /models/dflash_copy 0.05 32768 4 "$2" 30100 "$3"',
            str(SCRIPT), str(out), str(tmp_path / "site"), *extra]
    subprocess.run(["bash", "-c", *call], check=True, timeout=30)
    return out


@pytest.mark.parametrize("extra", ["", '--max-running-requests, "8"'])
def test_the_gpu_inventory_loads_with_its_args(tmp_path: Path, extra: str) -> None:
    host = load_inventory(str(written(tmp_path, extra))).hosts["h200"]
    args = host.service.args
    assert args[:2] == ["--model-path", "/models/hyb_copy"] and args[args.index("--port") + 1] == "30100"
    assert (args[-2:] == ["--max-running-requests", "8"]) == bool(extra)
    assert host.package_root == str(tmp_path / "site")
