"""Fixtures for the store tests: real sglang 0.5.17 package trees, a helper context, tmpfs mounts, tree hashes.

- `full_site`, `full_ctx`: a copy of the real installed release (sandbox image, cached under
  ~/.cache/ddtree-deploy) and the helper context for it.
- `site`, `ctx`: the few real files the `mini` test overlay patches plus the dist-info, for the
  many tests that do not need 80 MB (ops are called in-process through `ctx`).
- `layout`: runs a test twice, with the store's objects loose and with every batch packed (the
  small package has fewer files than objects.PACK_MIN, so it is loose unless told otherwise).
Plain helpers (tree hashes, tmpfs, in-process push) are in store_helpers.py.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from store_helpers import OVERLAYS, build_small_site, make_ctx

from ddtree_deploy.catalog import load_overlay
from ddtree_deploy.hostside import objects
from ddtree_deploy.hostside.common import Context
from ddtree_deploy.overlay import Overlay
from sandbox.hosts import release_image


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
def mini() -> Callable[[str], Overlay]:
    return lambda version: load_overlay(f"mini@{version}", OVERLAYS)


@pytest.fixture(params=["loose", "packed"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "packed":
        monkeypatch.setattr(objects, "PACK_MIN", 1)
    return str(request.param)
