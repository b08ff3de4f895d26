"""Fixtures for service and probe tests: a small host tree, a free port, and a LocalTransport to it.

Each transport holds the host lock, as a playbook's `preflight` takes it: the server's start and stop
refuse a caller without it. The host's package root holds a small `sglang` package with a real-shaped dist-info (the stand-in
byte-compiles every module of it, so a broken module makes the server refuse to start, as the real
one would). The server is `sandbox/standin_server.py` run by this python; every test's server is
stopped (whole group) when the test ends.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddtree_deploy import service
from ddtree_deploy.inventory import HostSpec, ProcessService
from ddtree_deploy.protocol import LockController
from ddtree_deploy.remote import locks
from ddtree_deploy.transport import LocalTransport

STANDIN = Path(__file__).resolve().parents[2] / "sandbox" / "standin_server.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def locked_transport(host: HostSpec) -> LocalTransport:
    """A transport to `host` that holds its lock, as a playbook does after `preflight`."""
    transport = LocalTransport(host, owner="test")
    locks.lock(transport, ttl_s=600, controller=LockController(host="test", pid=os.getpid()))
    return transport


def make_package_root(root: Path, version: str = "0.5.17") -> Path:
    pkg = root / "sglang"
    (pkg / "srt" / "speculative").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (pkg / "srt" / "__init__.py").write_text("")
    (pkg / "srt" / "speculative" / "__init__.py").write_text("")
    (pkg / "srt" / "speculative" / "spec_info.py").write_text("ALGORITHMS = ['EAGLE', 'DFLASH']\n")
    dist = root / f"sglang-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return root


@dataclass
class ServiceHost:
    """A host under test: its root, package root, port and a transport factory."""

    root: Path
    package_root: Path
    port: int

    def spec(self, args: list[str] | None = None, env: dict[str, str] | None = None,
             command: list[str] | None = None, **fields: Any) -> ProcessService:
        base = ["--model-path", "tiny", "--port", str(self.port), "--enable-metrics",
                "--package-root", str(self.package_root),
                "--standin-compile-cache", str(self.root / "compile-cache.json")]
        return ProcessService(command=command or [sys.executable, str(STANDIN)], args=base + (args or []),
                              env=env or {}, port=self.port, **fields)

    def transport(self, spec: ProcessService, probes: list[Any] | None = None) -> LocalTransport:
        host = HostSpec(name="sbx", transport="local", python=sys.executable, package_root=str(self.package_root),
                        state_dir=str(self.root / "state"), service=spec, probes=probes or [])
        return locked_transport(host)


@pytest.fixture
def svc_host(tmp_path: Path) -> Iterator[ServiceHost]:
    host = ServiceHost(root=tmp_path, package_root=make_package_root(tmp_path / "site"), port=free_port())
    yield host
    # whatever a test started, stop it: its record lives in the state dir, any spec of this port finds it
    service.stop(host.transport(host.spec()), grace_s=0)


@pytest.fixture
def group_members() -> Callable[[int], list[int]]:
    """Independent of the helper: the live pids of a process group, read from /proc."""
    def members(pgid: int) -> list[int]:
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                found.append(int(name))
        return found

    return members
