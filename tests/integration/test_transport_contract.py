"""One transport contract: LocalTransport and SSHTransport give the same helper answers for the same host tree."""

from __future__ import annotations

import base64
import json
import marshal
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sshd_fleet import Fleet

from ddtree_deploy.errors import DeployError, HelperError
from ddtree_deploy.inventory import HostSpec, load_inventory
from ddtree_deploy.transport import LocalTransport, SSHTransport, Transport, transport_for

KINDS = ["local", "ssh"]
# Facts that must not depend on how the helper was reached.
FINGERPRINT_FACTS = ("python_version", "python_executable", "python_prefix", "abi_tag", "package_root", "packages",
                     "torch_version", "torch_cuda", "driver_version", "gpus")


def spec_for(fleet: Fleet, name: str, kind: str, state_base: Path, **extra: Any) -> tuple[HostSpec, Any]:
    inventory = fleet.write_inventory(state_base.parent / f"inventory-{kind}.yaml", state_base=state_base,
                                      hosts={name: {"transport": kind, **extra}})
    inv = load_inventory(str(inventory))
    return inv.hosts[name], inv.ssh


@pytest.fixture
def host_path(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local transport runs with the host's tools on PATH, as the SSH session does (sshd's SetEnv)."""
    monkeypatch.setenv("PATH", fleet.hosts["ct129"].env()["PATH"])


@pytest.fixture(params=KINDS)
def transport(request: pytest.FixtureRequest, fleet: Fleet, tmp_path: Path, host_path: None) -> Iterator[Transport]:
    spec, ssh = spec_for(fleet, "ct129", request.param, tmp_path / "state")
    t = transport_for(spec, ssh, owner="contract-test")
    assert isinstance(t, LocalTransport if request.param == "local" else SSHTransport)
    yield t
    t.close()


def test_fingerprint_reads_the_host_tree(transport: Transport, fleet: Fleet) -> None:
    data = transport.call("fingerprint")

    assert data["package_root"] == str(fleet.hosts["ct129"].package_root)
    assert data["packages"]["sglang"]["version"] == "0.5.17"
    assert data["torch_version"] == "2.11.0+cu130" and data["torch_cuda"] == "13.0"
    assert data["packages"]["sglang-kernel"]["version"] == "0.4.5"
    assert data["driver_version"] == "580.95.05"
    assert [gpu["name"] for gpu in data["gpus"]] == ["NVIDIA H200"]


def test_both_transports_answer_the_same_facts(fleet: Fleet, tmp_path: Path, host_path: None) -> None:
    answers = {}
    for kind in KINDS:
        spec, ssh = spec_for(fleet, "ct129", kind, tmp_path / "state")
        t = transport_for(spec, ssh)
        try:
            data = t.call("fingerprint")
            answers[kind] = ({key: data[key] for key in FINGERPRINT_FACTS}, t.call("state"))
        finally:
            t.close()
    assert answers["local"] == answers["ssh"]


def test_state_of_a_new_host_is_empty(transport: Transport, tmp_path: Path) -> None:
    data = transport.call("state")

    assert data["deployed"] is None and data["lock"] is None and data["journal"] is None
    assert data["history"] == []
    assert Path(data["state_dir"]).parent == tmp_path / "state" / "ct129"
    assert not Path(data["state_dir"]).exists()  # reading state creates nothing


def test_the_helper_runs_the_controllers_bytecode_when_its_python_reads_it_and_else_the_sources(
        transport: Transport, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import ddtree_deploy.transport as transport_module

    sent = transport_module.hostside_bytecode()
    marked = compile(transport_module.hostside_modules()["facts"] + "\nOPS['fingerprint'] = lambda ctx, args: {'from': 'bytecode'}\n",
                     "facts.py", "exec")
    bytecode = dict(sent["bytecode"], facts=base64.b64encode(marshal.dumps(marked)).decode())
    monkeypatch.setattr(transport_module, "hostside_bytecode", lambda: dict(sent, bytecode=bytecode))
    assert transport.call("fingerprint") == {"from": "bytecode"}  # this python reads it: the sources are not compiled
    transport.close()
    monkeypatch.setattr(transport_module, "hostside_bytecode", lambda: dict(sent, bytecode=bytecode, magic="b3RoZXI="))
    assert "package_root" in transport.call("fingerprint")  # another python's magic: compiled from the sources
    transport.close()
    monkeypatch.setattr(transport_module, "hostside_bytecode", lambda: dict(sent, bytecode=dict(bytecode, facts="bm90")))
    assert "package_root" in transport.call("fingerprint")  # bytecode that does not load: the sources again
    assert not (tmp_path / "state").exists()  # nothing is cached on the host


def test_a_helper_that_died_with_our_request_unread_ends_without_a_broken_pipe() -> None:
    from ddtree_deploy.transport import _spawn

    session = _spawn(["true"], "h", "python_not_found", "")  # exits without reading its stdin
    session.proc.wait()
    with pytest.raises(BrokenPipeError):
        session.send(b"{}\n")  # stays in the writer's buffer: the flush failed
    assert session.finish() == (0, b"")


def test_lock_cycle_and_second_locker(transport: Transport) -> None:
    first = transport.call("lock", {"owner": "alice", "ttl_s": 600})
    assert first["replaced"] is None
    state_dir = Path(transport.call("state")["state_dir"])
    assert stat.S_IMODE(os.stat(state_dir).st_mode) == 0o700
    assert transport.call("lock", {"owner": "alice"})["lock"]["owner"] == "alice"  # re-entrant for its owner

    refused = transport.run_helper("lock", {"owner": "bob"})
    assert refused.exit_code == 0 and not refused.ok
    assert refused.error().code == "locked" and "alice" in refused.error().message
    with pytest.raises(HelperError) as unlock_refused:
        transport.call("unlock", {"owner": "bob"})
    assert unlock_refused.value.code == "locked"

    assert transport.call("unlock", {"owner": "alice"})["released"]["owner"] == "alice"
    assert transport.call("lock", {"owner": "bob"})["lock"]["owner"] == "bob"
    forced = transport.call("unlock", {"owner": "carol", "force": True})
    assert forced["released"]["owner"] == "bob"
    assert transport.call("state")["history"][-1]["forced"] is True


def test_expired_lock_is_taken_over(transport: Transport) -> None:
    transport.call("lock", {"owner": "alice", "ttl_s": 0})
    assert transport.call("state")["lock"]["expired"] is True
    taken = transport.call("lock", {"owner": "bob"})
    assert taken["replaced"]["owner"] == "alice"


def test_a_lock_left_empty_by_a_power_loss_counts_as_expired(transport: Transport) -> None:
    transport.call("lock", {"owner": "alice"})
    state_dir = Path(transport.call("state")["state_dir"])
    (state_dir / "lock").write_bytes(b"")  # as a power loss can leave it: its bytes never reached the disk
    assert transport.call("state")["lock"]["expired"] is True
    taken = transport.call("lock", {"owner": "bob"})
    assert taken["replaced"]["unreadable"] is True
    assert json.loads((state_dir / "lock").read_text())["owner"] == "bob"
    assert [p.name for p in state_dir.iterdir() if p.name.startswith(".ddtree-tmp-")] == []


def test_unknown_op_is_refused_with_a_code(transport: Transport) -> None:
    with pytest.raises(HelperError) as refused:
        transport.call("no-such-op")
    assert refused.value.code == "unknown_op"
    assert refused.value.host == "ct129"


@pytest.mark.parametrize("kind", KINDS)
def test_package_root_without_sglang_is_refused(kind: str, fleet: Fleet, tmp_path: Path) -> None:
    empty = tmp_path / "empty site"
    empty.mkdir()
    spec, ssh = spec_for(fleet, "ct129", kind, tmp_path / "state", package_root=str(empty))
    t = transport_for(spec, ssh)
    try:
        with pytest.raises(HelperError) as refused:
            t.call("state")
    finally:
        t.close()
    assert refused.value.code == "package_not_found"
    assert str(empty) in refused.value.message


@pytest.mark.parametrize("kind", KINDS)
def test_missing_python_is_an_error_naming_it(kind: str, fleet: Fleet, tmp_path: Path) -> None:
    missing = tmp_path / "gone" / "bin" / "python3"
    spec, ssh = spec_for(fleet, "ct129", kind, tmp_path / "state", python=str(missing))
    t = transport_for(spec, ssh)
    try:
        with pytest.raises(DeployError) as refused:
            t.call("state")
    finally:
        t.close()
    assert str(missing) in str(refused.value)
    assert refused.value.host == "ct129"
