"""Resolving ssh_config aliases: which resolver serves, both reading the same file alike, and refused settings."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ddtree_deploy.errors import InventoryError
from ddtree_deploy.inventory import load_inventory
from ddtree_deploy.sshconfig import RESOLVER_ENV, resolve, resolver, split_hop

RESOLVERS = ["openssh", "paramiko"] if shutil.which("ssh") else ["paramiko"]


def test_without_openssh_s_client_on_path_paramiko_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no `ssh` here
    assert resolver() == "paramiko"
    (tmp_path / "config").write_text("Host a\n  HostName 10.0.0.9\n")
    assert resolve("a", str(tmp_path / "config"), host="a").resolver == "paramiko"


def test_an_unknown_resolver_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RESOLVER_ENV, "putty")
    with pytest.raises(InventoryError, match=f"{RESOLVER_ENV}='putty'"):
        resolver()


@pytest.mark.parametrize("which", RESOLVERS)
def test_both_resolvers_read_include_tokens_and_jumps_alike(
        which: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RESOLVER_ENV, which)
    key = tmp_path / "10.0.0.5_deploy_key"
    key.write_text("not read here\n")
    (tmp_path / "hosts.conf").write_text(
        f"Host gpu1\n  HostName 10.0.0.5\n  Port 2222\n  User deploy\n  IdentityFile {tmp_path}/%h_%r_key\n"
        f"  IdentityFile {tmp_path}/missing_key\n  IdentitiesOnly yes\n  ProxyJump admin@bastion:2200,inner\n"
        "  StrictHostKeyChecking no\n")
    (tmp_path / "config").write_text(f"Include {tmp_path}/*.conf\nHost *\n  Port 2999\n")

    target = resolve("gpu1", str(tmp_path / "config"), host="gpu1")

    assert (target.hostname, target.port, target.user) == ("10.0.0.5", 2222, "deploy")
    assert target.identity_files == (str(key),)  # tokens expanded, a missing file left out as ssh does
    assert target.identities_only and target.proxy_jump == ("admin@bastion:2200", "inner")
    assert target.resolver == which
    hop = resolve("bastion", str(tmp_path / "config"), host="gpu1", user="admin", port=2200)
    assert (hop.hostname, hop.user, hop.port) == ("bastion", "admin", 2200)


@pytest.mark.parametrize("which", RESOLVERS)
def test_an_unreadable_config_names_the_file(which: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RESOLVER_ENV, which)
    with pytest.raises(InventoryError, match=str(tmp_path / "absent")) as caught:
        resolve("a", str(tmp_path / "absent"), host="a")
    assert caught.value.code == "ssh_config_invalid"


@pytest.mark.parametrize(("hop", "parts"), [
    ("bastion", ("bastion", None, None)),
    ("admin@bastion", ("bastion", "admin", None)),
    ("admin@bastion:2200", ("bastion", "admin", 2200)),
    ("ssh://admin@bastion:2200", ("bastion", "admin", 2200)),
])
def test_a_proxy_jump_hop_splits_as_ssh_reads_it(hop: str, parts: tuple[str, str | None, int | None]) -> None:
    assert split_hop(hop) == parts


def test_control_persist_s_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text("ssh: {control_persist_s: 300}\nhosts:\n  a: {python: /usr/bin/python3}\n")
    with pytest.raises(InventoryError) as caught:
        load_inventory(str(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: ssh: field control_persist_s: removed")
    assert "delete this key" in message
