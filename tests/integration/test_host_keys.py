"""Strict host-key checking against real sshd: unknown keys refused with their fingerprint, changed keys always refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sshd_fleet import Fleet, make_key

Cli = Callable[..., Any]


def inventory_with_known_hosts(fleet: Fleet, tmp_path: Path, known_hosts: Path) -> Path:
    return fleet.write_inventory(tmp_path / "inventory.yaml", state_base=tmp_path / "state",
                                 ssh={"known_hosts": str(known_hosts)})


def test_unknown_host_key_is_refused_with_its_fingerprint(fleet: Fleet, tmp_path: Path, cli: Cli) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(fleet.servers["ct200"].known_hosts_line())  # ct129's key was never recorded
    inventory = inventory_with_known_hosts(fleet, tmp_path, known_hosts)

    out = cli("status", "--json", inventory=inventory)

    assert out.exit_code == 1
    assert out.stderr == ""
    error = out.rows()["ct129"]["error"]
    assert error["code"] == "host_key_rejected"
    assert fleet.servers["ct129"].fingerprint() in error["message"]
    assert "--accept-new-host-key" in error["hint"]
    assert out.rows()["ct200"]["error"] is None
    assert known_hosts.read_text() == fleet.servers["ct200"].known_hosts_line()
    assert not (tmp_path / "state" / "ct129").exists()


def test_accept_new_host_key_records_keys_never_seen(fleet: Fleet, tmp_path: Path, cli: Cli) -> None:
    known_hosts = tmp_path / "known_hosts"  # does not exist yet
    inventory = inventory_with_known_hosts(fleet, tmp_path, known_hosts)

    refused = cli("status", "--json", inventory=inventory)
    assert refused.exit_code == 1
    assert not known_hosts.exists()

    accepted = cli("status", "--json", "--accept-new-host-key", inventory=inventory)
    assert accepted.exit_code == 0, accepted.stdout
    recorded = set(known_hosts.read_text().splitlines())
    assert recorded == {s.known_hosts_line().strip() for s in fleet.servers.values()}

    again = cli("status", "--json", inventory=inventory)  # no flag needed once recorded
    assert again.exit_code == 0, again.stdout
    assert set(known_hosts.read_text().splitlines()) == recorded


def test_changed_host_key_is_refused_even_with_accept_new(fleet: Fleet, tmp_path: Path, cli: Cli) -> None:
    impostor = make_key(tmp_path / "old_host_key", "ct129 before reinstall")
    old_key = " ".join(impostor.with_suffix(".pub").read_text().split()[:2])
    server = fleet.servers["ct129"]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{server.port} {old_key}\n" + fleet.servers["ct200"].known_hosts_line())
    before = known_hosts.read_bytes()
    inventory = inventory_with_known_hosts(fleet, tmp_path, known_hosts)

    for flags in ([], ["--accept-new-host-key"]):
        out = cli("status", "--json", *flags, inventory=inventory)

        assert out.exit_code == 1, flags
        error = out.rows()["ct129"]["error"]
        assert error["code"] == "host_key_rejected"
        assert "CHANGED" in error["message"]
        assert server.fingerprint() in error["message"]
        assert "ssh-keygen -R" in error["hint"]
        assert out.rows()["ct200"]["error"] is None
        assert known_hosts.read_bytes() == before


def jump_inventory(fleet: Fleet, tmp_path: Path, known_hosts: Path) -> Path:
    """ct200 reached through ct129 (`ProxyJump ct129`), as a host behind a bastion is."""
    ssh_config = fleet.write_ssh_config(tmp_path / "ssh_config", jumps={"ct200-via-ct129": ("ct200", "ct129")})
    return fleet.write_inventory(tmp_path / "inventory.yaml", state_base=tmp_path / "state",
                                 ssh={"config": str(ssh_config), "known_hosts": str(known_hosts)},
                                 hosts={"ct200": {"ssh": "ct200-via-ct129"}})


def test_proxy_jump_reaches_the_host_behind_the_jump_host(fleet: Fleet, tmp_path: Path, cli: Cli) -> None:
    inventory = jump_inventory(fleet, tmp_path, fleet.known_hosts)

    out = cli("status", "--json", "--host", "ct200", inventory=inventory)

    assert out.exit_code == 0, out.stdout
    assert out.rows()["ct200"]["result"]["cuda_variant"] == "cu128"
    assert "ProxyJump" in (tmp_path / "ssh_config").read_text()


def test_unknown_jump_host_key_is_refused(fleet: Fleet, tmp_path: Path, cli: Cli) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(fleet.servers["ct200"].known_hosts_line())  # the jump host ct129 is unknown
    inventory = jump_inventory(fleet, tmp_path, known_hosts)

    out = cli("status", "--json", "--host", "ct200", inventory=inventory)

    assert out.exit_code == 1, out.stdout
    error = out.rows()["ct200"]["error"]
    assert error["code"] == "host_key_rejected"
    assert fleet.servers["ct129"].fingerprint() in error["message"]
    assert known_hosts.read_text() == fleet.servers["ct200"].known_hosts_line()
