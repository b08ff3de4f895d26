"""OpenSSH control masters: a command leaves one per host, the next command's sessions go through it.

Real sshd on loopback, real `ssh`. Each test has its own runtime folder, so its masters are its own;
they are told to exit at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sshd_fleet import Fleet

from ddtree_deploy.errors import HelperError
from ddtree_deploy.inventory import HostSpec, load_inventory
from ddtree_deploy.transport import SSHTransport, _listening, transport_for


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="cm-"))  # not tmp_path: a socket path must stay short
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    try:
        yield folder
    finally:
        for sock in (folder / "ddtree-deploy" / "ssh").glob("cm-*"):
            subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "unused"], capture_output=True, check=False)
        shutil.rmtree(folder, ignore_errors=True)


def host(fleet: Fleet, tmp_path: Path, **ssh: Any) -> tuple[HostSpec, Any]:
    inventory = fleet.write_inventory(tmp_path / "inventory.yaml", state_base=tmp_path / "state", ssh=ssh or None)
    inv = load_inventory(str(inventory))
    return inv.hosts["ct129"], inv.ssh


def state_via(spec: HostSpec, ssh: Any) -> tuple[dict[str, Any], bool]:
    """The `state` answer and whether the session went through a control master."""
    t = transport_for(spec, ssh)
    assert isinstance(t, SSHTransport)
    try:
        return t.call("state"), t.muxed
    finally:
        t.close()


def masters(runtime: Path) -> list[Path]:
    return [p for p in (runtime / "ddtree-deploy" / "ssh").glob("cm-*") if _listening(str(p))]


def wait_for_master(runtime: Path) -> Path:
    deadline = time.monotonic() + 20
    while not masters(runtime):
        assert time.monotonic() < deadline, "no control master came up"
        time.sleep(0.05)
    return masters(runtime)[0]


def test_a_command_leaves_a_master_and_the_next_one_goes_through_it(fleet: Fleet, tmp_path: Path,
                                                                    runtime: Path) -> None:
    spec, ssh = host(fleet, tmp_path)
    first, first_muxed = state_via(spec, ssh)
    sock = wait_for_master(runtime)
    assert stat_mode(sock.parent) == 0o700
    second, second_muxed = state_via(spec, ssh)
    assert (first_muxed, second_muxed) == (False, True) and second == first

    subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "unused"], capture_output=True, check=True)
    third, third_muxed = state_via(spec, ssh)  # a master that is gone is not used: paramiko again, and a new one
    assert third == first and not third_muxed
    wait_for_master(runtime)


def test_a_missing_python_through_a_master_is_named_like_without_one(fleet: Fleet, tmp_path: Path,
                                                                     runtime: Path) -> None:
    spec, ssh = host(fleet, tmp_path)
    state_via(spec, ssh)
    wait_for_master(runtime)
    missing = tmp_path / "no env" / "bin" / "python3"
    t = transport_for(spec.model_copy(update={"python": str(missing)}), ssh)
    assert isinstance(t, SSHTransport)
    with pytest.raises(HelperError) as failed:  # the helper dies with our request unread: no BrokenPipeError
        t.call("state")
    t.close()
    assert t.muxed and str(missing) in str(failed.value)


def test_no_master_when_persistence_is_off(fleet: Fleet, tmp_path: Path, runtime: Path) -> None:
    spec, ssh = host(fleet, tmp_path, control_persist_s=0)
    state_via(spec, ssh)
    time.sleep(1)
    assert masters(runtime) == [] and not state_via(spec, ssh)[1]


def test_a_refused_host_key_leaves_no_master(fleet: Fleet, tmp_path: Path, runtime: Path) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(fleet.servers["ct200"].known_hosts_line())  # ct129's key was never recorded
    spec, ssh = host(fleet, tmp_path, known_hosts=str(known_hosts))
    t = transport_for(spec, ssh)
    with pytest.raises(Exception, match="unknown host key"):
        t.call("state")
    t.close()
    time.sleep(1)
    assert masters(runtime) == []


def stat_mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777
