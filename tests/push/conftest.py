"""A one-host sandbox fleet (ct200, `transport: local`, stand-in server) for the push pipeline tests.

The fleet is built once per module; every test leaves the host as it found it (healthy, the same
package bytes), and asserts so where that is the point.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from sandbox.fleet import REPO, build_fleet
from sandbox.hosts import package_files

HERE = Path(__file__).resolve().parent


@dataclass
class Fleet:
    root: Path
    inventory: Path
    overlays: Path
    env: dict[str, str]

    def host_spec(self, host: str = "ct200") -> dict[str, object]:
        spec: dict[str, object] = yaml.safe_load(self.inventory.read_text())["hosts"][host]
        return spec

    @property
    def package_root(self) -> Path:
        return Path(str(self.host_spec()["package_root"]))

    def cli(self, *args: str, extra_env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        env = {**self.env, **(extra_env or {})}
        return subprocess.run([sys.executable, "-m", "ddtree_deploy.cli", *args], env=env, text=True,
                              capture_output=True, timeout=timeout, check=False)

    def json(self, *args: str) -> tuple[int, dict[str, object]]:
        proc = self.cli(*args, "--json")
        assert proc.stderr == "", proc.stderr
        return proc.returncode, json.loads(proc.stdout)

    def package_digest(self, host: str = "ct200") -> str:
        return package_digest(Path(str(self.host_spec(host)["package_root"])))


def package_digest(root: Path) -> str:
    """sha256 over every file of sglang/ and its dist-info: path, mode and content (bytecode caches aside)."""
    h = hashlib.sha256()
    for path in package_files(root):
        h.update(f"{path.relative_to(root)}\0{path.lstat().st_mode}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from started_fleet(tmp_path_factory.mktemp("fleet"), ("ct200",), ready_timeout_s=4.0)


def started_fleet(root: Path, names: tuple[str, ...], ready_timeout_s: float,
                  extra_args: list[str] | None = None) -> Iterator[Fleet]:
    """A sandbox fleet of `names` with this directory's overlays and its servers up; stopped when done."""
    inventory = build_fleet(root, names=names, extra_args=extra_args)
    _set_ready_timeout(inventory, ready_timeout_s)
    overlays = root / "overlays"
    for source in (HERE / "overlays").iterdir():
        (overlays / source.name).symlink_to(source)
    env = {**os.environ, "DDTREE_INVENTORY": str(inventory), "DDTREE_OVERLAYS": str(overlays),
           "DDTREE_AUDIT_LOG": str(root / "audit.jsonl"), "PYTHONPATH": str(REPO)}
    env.pop("DDTREE_TEST_PAUSE_AT", None)
    the_fleet = Fleet(root=root, inventory=inventory, overlays=overlays, env=env)
    started = the_fleet.cli("restart", "--all")
    assert started.returncode == 0, started.stdout + started.stderr
    yield the_fleet
    the_fleet.cli("stop", "--all")


def _set_ready_timeout(inventory: Path, seconds: float) -> None:
    """A short readiness timeout, so the never-ready case times out quickly."""
    data = yaml.safe_load(inventory.read_text())
    for host in data["hosts"].values():
        host["service"]["ready_timeout_s"] = seconds
    inventory.write_text(yaml.safe_dump(data))
