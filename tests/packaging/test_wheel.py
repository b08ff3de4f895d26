"""The wheel does everything a checkout does: built with `pip wheel`, installed into a fresh venv and
run from a folder outside the checkout, it lists the built-in overlays, pushes the newest DDTree
version to a sandbox host (`transport: local`, the real sglang files) and rolls it back bit-exact."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from sandbox.fleet import REPO, build_fleet
from tests.push.conftest import Fleet

BUILD_IGNORE = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", ".*_cache", ".venv",
                                      "sandbox-fleet", ".benchmarks")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip wheel . --no-deps` of a copy of the checkout (a build writes into its source folder)."""
    source = tmp_path_factory.mktemp("source") / "ddtree-deploy"
    shutil.copytree(REPO, source, ignore=BUILD_IGNORE, symlinks=True)
    dist = source / "dist"
    run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
         "-q", "-w", str(dist)], cwd=source)
    (built,) = dist.glob("ddtree_deploy-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel; its dependencies come from this python's site-packages.

    Those folders are named in a .pth file rather than with `--system-site-packages`, which would give
    the *base* interpreter's (a venv running the tests has its own); a folder named in a .pth is added
    to the path without its own .pth files, so an editable install of the checkout there stays out.
    """
    folder = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", str(folder)])
    python = str(folder / "bin" / "python")
    own = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    ours = {sysconfig.get_paths()[kind] for kind in ("purelib", "platlib")}
    Path(own, "test-dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(ours)))
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--disable-pip-version-check", str(wheel)])
    return folder


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working folder outside the checkout, with no ./overlays."""
    return tmp_path_factory.mktemp("elsewhere")


@pytest.fixture(scope="module")
def host_fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One sandbox host (ct200); its inventory path."""
    return build_fleet(tmp_path_factory.mktemp("fleet"), names=("ct200",))


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, **kwargs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def tool(venv: Path, outside: Path, *args: str, inventory: Path | None = None) -> tuple[int, dict[str, Any]]:
    """`ddtree-deploy ARGS --json` from the venv, in `outside`, with none of the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DDTREE_OVERLAYS", "DDTREE_INVENTORY")}
    env.update(DDTREE_AUDIT_LOG=str(outside / "audit.jsonl"))
    if inventory is not None:
        env["DDTREE_INVENTORY"] = str(inventory)
    proc = subprocess.run([str(venv / "bin" / "ddtree-deploy"), *args, "--json"], cwd=outside, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.stderr == "", proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_the_wheel_ships_every_module_overlay_file_and_playbook(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "ddtree_deploy").rglob("*.py")}
    assert modules and modules <= names, sorted(modules - names)  # pyproject's package list is complete
    for folder in ("overlays", "playbooks"):
        shipped = {f"ddtree_deploy/_builtin_{folder}/{p.relative_to(REPO / folder).as_posix()}"
                   for p in (REPO / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
        assert shipped and shipped <= names, sorted(shipped - names)


def _checkout_chain(name: str) -> dict[str, str | None]:
    """Every version of overlay `name` in this checkout and the version it inherits: what the wheel must carry."""
    manifests = (yaml.safe_load(path.read_text()) for path in (REPO / "overlays" / name).glob("*/overlay.yaml"))
    return {str(m["version"]): m.get("inherits") for m in manifests}


def test_from_outside_the_checkout_it_lists_pushes_and_rolls_back(venv: Path, outside: Path,
                                                                  host_fleet: Path) -> None:
    code, listed = tool(venv, outside, "overlay", "list")
    assert code == 0
    (builtin,) = listed["data"]["folders"]
    assert builtin["origin"] == "built-in" and Path(builtin["path"]).is_relative_to(venv)
    chain = {row["version"]: row["inherits"] for row in listed["data"]["overlays"] if row["name"] == "ddtree"}
    assert chain == _checkout_chain("ddtree") and chain["0.1.0"] is None and chain["0.2.2"] == "0.2.1"

    fleet = Fleet(root=outside, inventory=host_fleet, overlays=outside, env={})
    package_root = fleet.package_root
    assert tool(venv, outside, "restart", "--all", inventory=host_fleet)[0] == 0
    try:
        before = fleet.package_digest()
        code, pushed = tool(venv, outside, "push", "--host", "ct200", "--overlay", "ddtree@0.2.2", inventory=host_fleet)
        (row,) = pushed["data"]["hosts"]
        assert code == 0 and row["result"]["outcome"] == "ok", row
        landed = json.loads((REPO / "tests/overlay/plan_digests.json").read_text())["overlays/ddtree@0.2.2"]["files"]
        for path, change in landed.items():  # the bytes a push from the checkout lands (this host's RECORD aside)
            if not path.endswith("RECORD"):
                assert hashlib.sha256((package_root / path).read_bytes()).hexdigest() == change.split()[-1], path
        code, rolled = tool(venv, outside, "rollback", "--host", "ct200", inventory=host_fleet)
        assert code == 0 and rolled["data"]["hosts"][0]["result"]["outcome"] == "ok", rolled
        assert fleet.package_digest() == before
    finally:
        tool(venv, outside, "stop", "--all", inventory=host_fleet)
