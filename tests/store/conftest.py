"""Fixtures for the store tests: real sglang 0.5.17 package trees, a helper context, tmpfs mounts, tree hashes.

- `full_site`, `full_ctx`: a copy of the real installed release (sandbox image, cached under
  ~/.cache/ddtree-deploy) and the helper context for it.
- `site`, `ctx`: the few real files the `mini` test overlay patches plus the dist-info, for the
  many tests that do not need 80 MB (ops are called in-process through `ctx`).
- `inventory`: an inventory of one host, `sbx` (`transport: local`, no service), over `site`; the
  audit log goes to tmp_path.
- `sandbox_host`: ct200's host tree (the whole release, torch metadata a push's checks accept) as
  `sbx` of its own inventory, no service: for pushes through the CLI.
- `layout`: runs a test twice, with the store's objects loose and with every batch packed (the
  small package has fewer files than objects.PACK_MIN, so it is loose unless told otherwise).
Plain helpers (tree hashes, tmpfs, in-process push) are in store_helpers.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from store_helpers import OVERLAYS, LocalHost, build_small_site, make_ctx

from ddtree_deploy.catalog import load_overlay
from ddtree_deploy.history import AUDIT_ENV
from ddtree_deploy.hostside import objects
from ddtree_deploy.hostside.common import Context
from ddtree_deploy.inventory import load_inventory
from ddtree_deploy.overlay import Overlay
from ddtree_deploy.transport import LocalTransport
from sandbox.hosts import SandboxHost, release_image


@pytest.fixture(scope="session")
def pristine() -> Path:
    """site-packages of `pip install sglang==0.5.17` (built once, then cached between runs)."""
    return release_image() / "site-packages"


@pytest.fixture
def full_site(pristine: Path, tmp_path: Path) -> Path:
    """A copy of the whole release (about 3,900 files, 80 MB)."""
    target = tmp_path / "full"
    subprocess.run(["cp", "-a", f"{pristine}/.", str(target)], check=True)
    return target


@pytest.fixture
def full_ctx(full_site: Path, tmp_path: Path) -> Context:
    return make_ctx(full_site, tmp_path / "full-state")


@pytest.fixture
def site(pristine: Path, tmp_path: Path) -> Path:
    """The release's files that the mini overlay touches, plus its dist-info: a tiny real package."""
    return build_small_site(pristine, tmp_path / "site")


@pytest.fixture
def ctx(site: Path, tmp_path: Path) -> Context:
    return make_ctx(site, tmp_path / "state")


@pytest.fixture
def inventory(site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    host = {"python": sys.executable, "package_root": str(site), "state_dir": str(tmp_path / "state")}
    return _local_inventory(tmp_path, host, monkeypatch)


@pytest.fixture
def sandbox_host(make_host: Callable[..., SandboxHost], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalHost:
    host = make_host("ct200")
    inventory = _local_inventory(tmp_path, host.inventory_entry(), monkeypatch)
    spec = load_inventory(str(inventory)).hosts["sbx"]
    return LocalHost(inventory=inventory, site=host.package_root, transport=LocalTransport(spec, owner="tests"))


def _local_inventory(tmp_path: Path, host: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> Path:
    """inventory.yaml with `host` as `sbx` (transport: local); the audit log goes to tmp_path."""
    monkeypatch.setenv(AUDIT_ENV, str(tmp_path / "audit.jsonl"))
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"sbx": {"transport": "local", **host}}}))
    return path


@pytest.fixture
def mini() -> Callable[[str], Overlay]:
    return lambda version: load_overlay(f"mini@{version}", OVERLAYS)


@pytest.fixture(params=["loose", "packed"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "packed":
        monkeypatch.setattr(objects, "PACK_MIN", 1)
    return str(request.param)
