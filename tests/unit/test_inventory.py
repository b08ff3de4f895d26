"""Inventory loading: precedence, selection, and one-line errors that name file, host and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree_deploy.errors import InventoryError, UsageError
from ddtree_deploy.inventory import load_inventory, select_hosts


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    return path


BASIC = """
ssh: {config: ./ssh_config, known_hosts: keys/known_hosts}
defaults: {python: /root/ml-env/bin/python3, groups: [eval]}
hosts:
  ct129: {ssh: ct129}
  ct200: {python: /opt/env/bin/python3, groups: [eval, canary]}
  sbx: {transport: local, groups: [sandbox]}
"""


def test_defaults_merge_under_host_keys(tmp_path: Path) -> None:
    inv = load_inventory(str(write(tmp_path, BASIC)))
    assert inv.hosts["ct129"].python == "/root/ml-env/bin/python3"
    assert inv.hosts["ct200"].python == "/opt/env/bin/python3"
    assert inv.hosts["sbx"].transport == "local"
    assert inv.groups() == {"eval": ["ct129", "ct200", "sbx"], "canary": ["ct200"], "sandbox": ["sbx"]}


def test_ssh_paths_are_relative_to_the_inventory(tmp_path: Path) -> None:
    inv = load_inventory(str(write(tmp_path, BASIC)))
    assert inv.ssh.config == str(tmp_path / "ssh_config")
    assert inv.ssh.known_hosts == str(tmp_path / "keys" / "known_hosts")


def test_env_variable_names_the_inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDTREE_INVENTORY", str(write(tmp_path, BASIC)))
    assert set(load_inventory(None).hosts) == {"ct129", "ct200", "sbx"}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("hosts: {ct200: {python: /p, colour: red}}", "host ct200: field colour: unknown key"),
        ("hosts: {ct200: {python: /p, service: {kind: process, command: [x], port: abc}}}",
         "host ct200: field service.process.port"),
        ("hosts: {ct200: {}}", "host ct200: field python: Field required"),
        ("hosts: {ct200: {python: /p, ssh: '-oProxyCommand=touch /tmp/x'}}", "host ct200: field ssh: ssh alias '-oProxyCommand"),
        ("hosts: {ct200: {python: /p, ssh: 10.0.0.5}}", "host ct200: field ssh: ssh alias '10.0.0.5' is an address"),
        ("hosts: {ct200: {python: /p}}\nextra: 1", "unknown top-level key 'extra'"),
        ("hosts: [ct200", "malformed YAML"),
        ("hosts: {}", "no hosts defined"),
        ("- a\n- b", "inventory: top level must be a mapping"),
    ],
)
def test_bad_inventory_is_one_line_naming_file_and_field(tmp_path: Path, text: str, needle: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as info:
        load_inventory(str(path))
    message = str(info.value)
    assert str(path) in message and needle in message
    assert "\n" not in message


def test_missing_file_says_how_to_point_at_one(tmp_path: Path) -> None:
    with pytest.raises(InventoryError) as info:
        load_inventory(str(tmp_path / "nope.yaml"))
    assert "DDTREE_INVENTORY" in info.value.hint


def test_selection_by_host_group_and_all(tmp_path: Path) -> None:
    inv = load_inventory(str(write(tmp_path, BASIC)))
    assert [h.name for h in select_hosts(inv, names=["ct200"])] == ["ct200"]
    assert [h.name for h in select_hosts(inv, groups=["eval"])] == ["ct129", "ct200", "sbx"]
    assert [h.name for h in select_hosts(inv, groups=["sandbox"], names=["ct129"])] == ["ct129", "sbx"]
    assert [h.name for h in select_hosts(inv, all_hosts=True)] == ["ct129", "ct200", "sbx"]
    assert len(select_hosts(inv, default_all=True)) == 3


def test_unknown_host_lists_the_known_ones(tmp_path: Path) -> None:
    inv = load_inventory(str(write(tmp_path, BASIC)))
    with pytest.raises(UsageError) as info:
        select_hosts(inv, names=["ct300"])
    assert "ct300" in str(info.value) and "ct129, ct200, sbx" in info.value.hint


def test_no_selection_is_refused_when_no_default(tmp_path: Path) -> None:
    inv = load_inventory(str(write(tmp_path, BASIC)))
    with pytest.raises(UsageError):
        select_hosts(inv)


def test_the_team_inventory_loads() -> None:
    inv = load_inventory(str(Path(__file__).resolve().parents[2] / "inventory.yaml"))
    assert set(inv.hosts) == {"ct129", "ct200"} and inv.groups()["eval"] == ["ct129", "ct200"]


SERVICE_DEFAULTS = """
defaults:
  python: /p
  groups: [eval]
  service: {kind: process, command: [python3, -m, sglang.launch_server], args: [--port, "30000"], port: 30000,
            env: {A: "1", B: "2"}}
  probes: [{kind: http, path: /health, status: 200}]
hosts:
  ct129: {}
  ct200: {groups: [canary, eval], service: {port: 30001, env: {B: "3"}}, probes: []}
"""


def test_a_host_mapping_merges_into_the_default_one_keeping_its_other_keys(tmp_path: Path) -> None:
    inv = load_inventory(str(write(tmp_path, SERVICE_DEFAULTS)))
    service = inv.hosts["ct200"].service
    assert service is not None and service.kind == "process"
    assert service.port == 30001
    assert service.command == ["python3", "-m", "sglang.launch_server"]
    assert service.env == {"A": "1", "B": "3"}
    assert inv.hosts["ct129"].service is not None and inv.hosts["ct129"].service.port == 30000


def test_lists_replace_but_groups_add_in_order_without_repeats(tmp_path: Path) -> None:
    inv = load_inventory(str(write(tmp_path, SERVICE_DEFAULTS)))
    assert inv.hosts["ct200"].groups == ["eval", "canary"]
    assert inv.hosts["ct200"].probes == []
    assert len(inv.hosts["ct129"].probes) == 1
    assert inv.groups() == {"eval": ["ct129", "ct200"], "canary": ["ct200"]}


def test_a_host_service_of_another_kind_replaces_the_default_one(tmp_path: Path) -> None:
    text = SERVICE_DEFAULTS.replace("probes: []}", "service: {kind: systemd, unit: sglang.service, port: 30002}}")
    inv = load_inventory(str(write(tmp_path, text)))
    service = inv.hosts["ct200"].service
    assert service is not None and service.kind == "systemd" and service.port == 30002


def test_a_host_can_drop_the_default_service(tmp_path: Path) -> None:
    inv = load_inventory(str(write(tmp_path, SERVICE_DEFAULTS.replace("probes: []}", "service: null}"))))
    assert inv.hosts["ct200"].service is None


def test_a_malformed_host_groups_value_is_named_not_merged(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="host ct200: field groups"):
        load_inventory(str(write(tmp_path, "defaults: {python: /p, groups: [eval]}\nhosts: {ct200: {groups: eval}}")))
