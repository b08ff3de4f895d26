"""`ddtree-deploy status --inventory hosts.ini` against real sshd hosts reached the way Ansible reaches them:
ansible_host, ansible_port, ansible_user and a key file, with our keys in host_vars/."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from sshd_fleet import Fleet

Cli = Callable[..., Any]


def write_ansible_inventory(fleet: Fleet, folder: Path) -> Path:
    """hosts.ini with every host as 127.0.0.1 and its port, plus group_vars/ and host_vars/ beside it."""
    lines = ["[eval]"]
    for name, server in fleet.servers.items():
        lines.append(f"{name} ansible_host=127.0.0.1 ansible_port={server.port} ansible_user=root")
        host = fleet.hosts[name]
        (folder / "host_vars").mkdir(parents=True, exist_ok=True)
        (folder / "host_vars" / f"{name}.yml").write_text(yaml.safe_dump({
            "ansible_python_interpreter": str(host.python),
            "ddtree_deploy": {"package_root": str(host.package_root), "state_dir": str(folder / "state" / name)},
        }))
    lines += ["", "[eval:vars]", f"ansible_ssh_private_key_file={fleet.client_key}"]
    (folder / "group_vars").mkdir(exist_ok=True)
    (folder / "empty_ssh_config").write_text("")  # no ~/.ssh/config: the inventory alone says how to connect
    (folder / "group_vars" / "all.yml").write_text(yaml.safe_dump({"ddtree_deploy_ssh": {
        "config": "empty_ssh_config", "known_hosts": str(fleet.known_hosts), "connect_timeout_s": 5}}))
    path = folder / "hosts.ini"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_status_reads_an_ansible_ini_inventory(fleet: Fleet, tmp_path: Path, cli: Cli) -> None:
    hosts_ini = write_ansible_inventory(fleet, tmp_path)

    out = cli("status", "--json", inventory=hosts_ini)

    assert out.exit_code == 0, out.stdout
    assert out.stderr == ""
    rows = out.rows()
    assert list(rows) == ["ct129", "ct200"]
    for name, variant in (("ct129", "cu130"), ("ct200", "cu128")):
        assert rows[name]["error"] is None, rows[name]
        assert rows[name]["result"]["cuda_variant"] == variant
        assert rows[name]["result"]["package_root"] == str(fleet.hosts[name].package_root)
    assert list(cli("status", "--json", "--group", "eval", "--host", "ct200", inventory=hosts_ini).rows()) == ["ct129", "ct200"]


def test_a_wrong_ansible_port_is_a_connection_error_naming_the_address(fleet: Fleet, tmp_path: Path, cli: Cli) -> None:
    hosts_ini = write_ansible_inventory(fleet, tmp_path)
    hosts_ini.write_text(hosts_ini.read_text().replace(f"ansible_port={fleet.servers['ct200'].port}", "ansible_port=1"))

    rows = cli("status", "--json", inventory=hosts_ini).rows()

    assert rows["ct129"]["error"] is None
    assert "127.0.0.1:1" in rows["ct200"]["error"]["message"]
