"""Fixtures for the ABI tests: fake site-packages trees, an nvidia-smi stand-in on PATH, local hosts."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ddtree_deploy.inventory import HostSpec
from ddtree_deploy.transport import LocalTransport

# The torch pins of sglang 0.5.17's real METADATA (plus an extra-only and a marker-guarded line).
SGLANG_0517_REQUIRES = [
    "flashinfer_python[cu13]==0.6.15.post1",
    "sglang-kernel==0.4.5",
    "torch==2.11.0",
    "torchaudio==2.11.0",
    'torchcodec==0.11.1; sys_platform != "linux" or (sys_platform == "linux" and platform_machine != "aarch64")',
    'sglang[test]; extra == "dev"',
]

SiteFactory = Callable[..., Path]


def write_dist(site: Path, name: str, version: str, requires: list[str] | None = None) -> None:
    """A `<name>-<version>.dist-info/METADATA` as pip writes it (name normalised with underscores)."""
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True)
    lines = ["Metadata-Version: 2.4", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires or []]
    (folder / "METADATA").write_text("\n".join(lines) + "\n\nLong description, not headers.\nName: not-this\n")


def write_torch(site: Path, version: str, cuda: str | None, dist_version: str | None = None) -> None:
    """torch's dist-info and a torch/version.py shaped like the real one (annotated assignments).

    PyPI's wheels write no local tag into the dist-info (`dist_version` 2.11.0 for version.py's 2.11.0+cu130).
    """
    write_dist(site, "torch", dist_version or version, ["filelock", "sympy>=1.13.3"])
    (site / "torch").mkdir()
    (site / "torch" / "version.py").write_text(
        "from typing import Optional\n\n"
        "__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip']\n"
        f"__version__ = {version!r}\n"
        "debug = False\n"
        f"cuda: Optional[str] = {cuda!r}\n"
        "git_version = 'abc123'\n"
        "hip: Optional[str] = None\n"
        "computed = '.'.join(['not', 'a', 'literal'])\n"
    )


@pytest.fixture
def make_site(tmp_path: Path) -> SiteFactory:
    """Build a package root: sglang 0.5.17 (real pins), torch for a variant, and extra dists."""
    counter = iter(range(1000))

    def make(torch: str | None = "2.11.0+cu128", cuda: str | None = "12.8",
             dists: dict[str, tuple[str, list[str]]] | None = None, torch_dist: str | None = None) -> Path:
        site = tmp_path / f"site{next(counter)}"
        (site / "sglang").mkdir(parents=True)
        (site / "sglang" / "__init__.py").write_text("")
        write_dist(site, "sglang", "0.5.17", SGLANG_0517_REQUIRES)
        if torch is not None:
            write_torch(site, torch, cuda, torch_dist)
        for name, (version, requires) in (dists or {}).items():
            write_dist(site, name, version, requires)
        return site

    return make


@pytest.fixture
def nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """Write an nvidia-smi stand-in that prints `lines` and exits `code`; first on PATH unless told otherwise."""
    def install(lines: list[str], code: int = 0, on_path: bool = True) -> Path:
        folder = tmp_path / f"smi-bin-{len(lines)}-{code}"
        folder.mkdir()
        script = folder / "nvidia-smi"
        body = "".join(f"echo {line!r}\n" for line in lines)
        script.write_text(f"#!/bin/sh\n{body}exit {code}\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        if on_path:
            monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")
        return script

    return install


@pytest.fixture
def no_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PATH on which no nvidia-smi can be found (the host python is run by absolute path)."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def local_host(name: str, site: Path, state: Path, python: str = sys.executable) -> HostSpec:
    return HostSpec(name=name, transport="local", python=python, package_root=str(site), state_dir=str(state))


@pytest.fixture
def fingerprint_of(tmp_path: Path) -> Callable[..., dict[str, object]]:
    """Run the real helper's `fingerprint` op on a package root through LocalTransport."""
    def run(site: Path, **args: object) -> dict[str, object]:
        return LocalTransport(local_host("sbx", site, tmp_path / "state")).call("fingerprint", dict(args))

    return run
