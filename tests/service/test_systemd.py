"""The systemd kind, against a fake systemctl/journalctl on PATH (no systemd runs here): same reports as a process."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ddtree_deploy import service
from ddtree_deploy.inventory import HostSpec, SystemdService
from ddtree_deploy.transport import LocalTransport
from tests.service.conftest import STANDIN, locked_transport

if TYPE_CHECKING:
    from tests.service.conftest import ServiceHost

FAKE = Path(__file__).with_name("fake_systemd.py")


@pytest.fixture
def unit_transport(svc_host: ServiceHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalTransport]:
    bin_dir, state = tmp_path / "bin", tmp_path / "systemd"
    bin_dir.mkdir()
    state.mkdir()
    for tool in ("systemctl", "journalctl"):
        wrapper = bin_dir / tool
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" {tool} "$@"\n')
        wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SYSTEMD_DIR", str(state))
    monkeypatch.setenv("FAKE_SYSTEMD_COMMAND", json.dumps([sys.executable, str(STANDIN), *svc_host.spec().args]))
    spec = SystemdService(kind="systemd", unit="sglang.service", port=svc_host.port, ready_timeout_s=60)
    host = HostSpec(name="sbx", transport="local", python=sys.executable, package_root=str(svc_host.package_root),
                    state_dir=str(svc_host.root / "state"), service=spec)
    transport = locked_transport(host)
    yield transport
    service.stop(transport)


def test_unit_restart_status_logs_stop(unit_transport: LocalTransport) -> None:
    report = service.restart(unit_transport, ["--speculative-algorithm", "DDTREE"])
    assert report.ready, report
    assert report.argv == ["--speculative-algorithm", "DDTREE"]  # recorded; the unit owns its command line
    state = service.status(unit_transport)
    assert state.kind == "systemd" and state.healthy and state.pid == report.pid
    assert "fired up" in service.logs(unit_transport, n=40).text
    stopped = service.stop(unit_transport)
    assert stopped.was_running and stopped.port_free
    assert not service.status(unit_transport).running


def test_unit_that_crashes_is_reported_from_the_journal(
        svc_host: ServiceHost, unit_transport: LocalTransport) -> None:
    (svc_host.package_root / "sglang" / "broken.py").write_text("return = 1\n")
    report = service.restart(unit_transport)
    assert not report.ready and report.reason in ("exited", "fatal_log")
    assert any("SyntaxError" in line for line in report.log_tail)


def test_journal_follow_reads_only_new_entries(unit_transport: LocalTransport) -> None:
    assert service.restart(unit_transport).ready
    tail = service.logs(unit_transport, n=1)
    assert service.status(unit_transport).healthy
    new = service.logs(unit_transport, offset=tail.offset)
    assert new.text.count("\n") == 1 and '"GET /health HTTP/1.1" 200' in new.text
