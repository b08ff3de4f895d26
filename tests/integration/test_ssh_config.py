"""ssh_config read as OpenSSH reads it, by both resolvers, and strict host keys on every hop, against real sshd.

Every test runs once with `ssh -G` and once with paramiko's parser (`DDTREE_DEPLOY_SSH_RESOLVER`),
and `status --json` says which one served. ct129 doubles as the jump host in front of ct200.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from sshd_fleet import Fleet, make_key

from ddtree_deploy.errors import HostKeyError
from ddtree_deploy.inventory import load_inventory
from ddtree_deploy.sshconfig import RESOLVER_ENV
from ddtree_deploy.transport import transport_for

Cli = Callable[..., Any]


@pytest.fixture(params=["openssh", "paramiko"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(RESOLVER_ENV, request.param)
    return str(request.param)


def entry(fleet: Fleet, head: str, server: str, *extra: str) -> str:
    """An ssh_config block `head` (e.g. `Host x`) reaching `server`'s sshd, plus `extra` lines."""
    lines = [head, "  HostName 127.0.0.1", f"  Port {fleet.servers[server].port}", "  User root",
             f"  IdentityFile {fleet.client_key}", "  IdentitiesOnly yes", *(f"  {line}" for line in extra)]
    return "\n".join(lines) + "\n"


def inventory(fleet: Fleet, tmp_path: Path, config: str, known_hosts: Path | None = None,
              hosts: dict[str, str] | None = None) -> Path:
    """An inventory whose ssh_config is `config`, each host (name -> alias) reached through its alias."""
    (tmp_path / "ssh_config").write_text(config)
    aliases = hosts or {"ct129": "ct129", "ct200": "ct200"}
    entries = {name: fleet.hosts[name].inventory_entry(ssh=alias, state_dir=str(tmp_path / "state" / name))
               for name, alias in aliases.items()}
    ssh = {"config": str(tmp_path / "ssh_config"), "known_hosts": str(known_hosts or fleet.known_hosts),
           "connect_timeout_s": 5}
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({"ssh": ssh, "hosts": entries}))
    return path


def only(out: Any, name: str) -> dict[str, Any]:
    rows = out.rows()
    assert list(rows) == [name], out.stdout
    return dict(rows[name])


def test_an_included_file_holds_the_host_entry(fleet: Fleet, tmp_path: Path, cli: Cli, resolver: str) -> None:
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "ct200.conf").write_text(entry(fleet, "Host ct200-inc", "ct200"))
    config = f"Include {tmp_path}/conf.d/*.conf\n"
    inv = inventory(fleet, tmp_path, config, hosts={"ct200": "ct200-inc"})

    out = cli("status", "--json", inventory=inv)

    assert out.exit_code == 0, out.stdout
    row = only(out, "ct200")
    assert row["result"]["cuda_variant"] == "cu128"
    assert row["result"]["ssh_resolver"] == resolver


def test_a_match_block_gives_the_address(fleet: Fleet, tmp_path: Path, cli: Cli, resolver: str) -> None:
    # the Match block names the address; the catch-all after it would send ct129-m elsewhere (first value wins)
    config = entry(fleet, "Match originalhost ct129-m", "ct129") + "Host *\n  HostName 127.0.0.2\n  User nobody\n"
    inv = inventory(fleet, tmp_path, config, hosts={"ct129": "ct129-m"})

    out = cli("status", "--json", inventory=inv)

    assert out.exit_code == 0, out.stdout
    assert only(out, "ct129")["result"]["ssh_resolver"] == resolver


def jump_config(fleet: Fleet, *jump_extra: str) -> str:
    """ct200 behind ct129: `ct200-via` jumps through the alias `bastion` (ct129's sshd)."""
    return entry(fleet, "Host bastion", "ct129", *jump_extra) + entry(fleet, "Host ct200-via", "ct200",
                                                                       "ProxyJump bastion")


def test_proxy_jump_reaches_the_host_behind_the_jump_host(fleet: Fleet, tmp_path: Path, cli: Cli,
                                                          resolver: str) -> None:
    inv = inventory(fleet, tmp_path, jump_config(fleet), hosts={"ct200": "ct200-via"})

    out = cli("status", "--json", inventory=inv)

    assert out.exit_code == 0, out.stdout
    assert only(out, "ct200")["result"]["cuda_variant"] == "cu128"


def test_unknown_jump_host_key_is_refused_naming_the_jump_host(fleet: Fleet, tmp_path: Path, cli: Cli,
                                                               resolver: str) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(fleet.servers["ct200"].known_hosts_line())  # the jump host's key was never recorded
    # the user's own config waves the bastion through; the tool checks every hop anyway
    config = jump_config(fleet, "StrictHostKeyChecking no", "UserKnownHostsFile /dev/null")
    inv = inventory(fleet, tmp_path, config, known_hosts, hosts={"ct200": "ct200-via"})

    out = cli("status", "--json", inventory=inv)

    assert out.exit_code == 1, out.stdout
    error = only(out, "ct200")["error"]
    port = fleet.servers["ct129"].port
    assert error["code"] == "host_key_rejected"
    assert f"unknown host key for jump host bastion (root@127.0.0.1:{port})" in error["message"]
    assert fleet.servers["ct129"].fingerprint() in error["message"]
    assert "--accept-new-host-key" in error["hint"] and f"[127.0.0.1]:{port}" in error["hint"]
    assert known_hosts.read_text() == fleet.servers["ct200"].known_hosts_line()
    assert not (tmp_path / "state").exists()


def test_changed_jump_host_key_names_the_jump_host_and_its_known_hosts_line(
        fleet: Fleet, tmp_path: Path, cli: Cli, resolver: str) -> None:
    old = make_key(tmp_path / "old_bastion_key", "ct129 before reinstall")
    port = fleet.servers["ct129"].port
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {' '.join(old.with_suffix('.pub').read_text().split()[:2])}\n"
                           + fleet.servers["ct200"].known_hosts_line())
    before = known_hosts.read_bytes()
    inv = inventory(fleet, tmp_path, jump_config(fleet, "StrictHostKeyChecking no"), known_hosts,
                    hosts={"ct200": "ct200-via"})

    out = cli("status", "--json", "--accept-new-host-key", inventory=inv)

    assert out.exit_code == 1, out.stdout
    error = only(out, "ct200")["error"]
    assert error["code"] == "host_key_rejected"
    assert f"host key CHANGED for jump host bastion (root@127.0.0.1:{port})" in error["message"]
    assert f"ssh-keygen -R '[127.0.0.1]:{port}' -f {known_hosts}" in error["hint"]
    assert known_hosts.read_bytes() == before


def test_unknown_final_host_key_behind_a_known_jump_host_names_the_final_host(
        fleet: Fleet, tmp_path: Path, cli: Cli, resolver: str) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(fleet.servers["ct129"].known_hosts_line())  # the jump host only
    inv = inventory(fleet, tmp_path, jump_config(fleet), known_hosts, hosts={"ct200": "ct200-via"})

    out = cli("status", "--json", inventory=inv)

    error = only(out, "ct200")["error"]
    assert error["code"] == "host_key_rejected"
    assert f"unknown host key for root@127.0.0.1:{fleet.servers['ct200'].port}:" in error["message"]
    assert "jump host" not in error["message"]


def test_proxy_command_carries_the_connection(fleet: Fleet, tmp_path: Path, cli: Cli, resolver: str) -> None:
    bastion = entry(fleet, "Host bastion", "ct129", f"UserKnownHostsFile {fleet.known_hosts}",
                    "StrictHostKeyChecking yes", "BatchMode yes")
    config = bastion + entry(fleet, "Host ct200-pc", "ct200", f"ProxyCommand ssh -F {tmp_path}/ssh_config -W %h:%p bastion")
    inv = inventory(fleet, tmp_path, config, hosts={"ct200": "ct200-pc"})

    out = cli("status", "--json", inventory=inv)

    assert out.exit_code == 0, out.stdout
    assert only(out, "ct200")["result"]["cuda_variant"] == "cu128"


def test_a_key_deleted_from_known_hosts_is_refused_by_the_next_command(
        fleet: Fleet, tmp_path: Path, cli: Cli, resolver: str) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(fleet.known_hosts.read_text())
    inv = inventory(fleet, tmp_path, entry(fleet, "Host ct129", "ct129"), known_hosts, hosts={"ct129": "ct129"})
    assert cli("status", "--json", inventory=inv).exit_code == 0

    known_hosts.write_text(fleet.servers["ct200"].known_hosts_line())  # ct129's line deleted
    out = cli("status", "--json", inventory=inv)

    assert out.exit_code == 1
    assert only(out, "ct129")["error"]["code"] == "host_key_rejected"


def test_a_missing_ssh_config_is_bad_input_naming_it(fleet: Fleet, tmp_path: Path, cli: Cli, resolver: str) -> None:
    inv = inventory(fleet, tmp_path, "", hosts={"ct129": "ct129"})
    (tmp_path / "ssh_config").unlink()

    out = cli("status", "--json", inventory=inv)

    assert out.exit_code == 1 and out.stderr == ""
    error = only(out, "ct129")["error"]
    assert error["code"] == "ssh_config_invalid"
    assert str(tmp_path / "ssh_config") in error["message"]
    assert not (tmp_path / "state").exists()


def test_a_refused_host_behind_an_open_jump_host_stays_refused_on_the_next_op(
        fleet: Fleet, tmp_path: Path, resolver: str) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(fleet.servers["ct129"].known_hosts_line())  # the jump host opens; ct200 is refused
    inv = load_inventory(str(inventory(fleet, tmp_path, jump_config(fleet), known_hosts, hosts={"ct200": "ct200-via"})))
    transport = transport_for(inv.hosts["ct200"], inv.ssh)
    try:
        for _attempt in range(2):  # the second op must not find the jump host's connection and run there
            with pytest.raises(HostKeyError, match=f"127.0.0.1:{fleet.servers['ct200'].port}"):
                transport.run_helper("state")
    finally:
        transport.close()
