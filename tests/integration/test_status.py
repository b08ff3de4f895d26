"""`ddtree-deploy status` against real sshd hosts: rows, the --json envelope, and hosts that cannot answer."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sshd_fleet import Fleet

from ddtree_deploy.inventory import load_inventory
from ddtree_deploy.transport import transport_for

Cli = Callable[..., Any]


def test_status_json_reports_both_hosts_with_their_cuda_variants(fleet: Fleet, inventory: Path, cli: Cli) -> None:
    out = cli("status", "--json", inventory=inventory)

    assert out.exit_code == 0, out.stdout
    assert out.stderr == ""
    by_host = out.rows()
    assert list(by_host) == ["ct129", "ct200"]
    for name, variant, torch in (("ct129", "cu130", "2.11.0+cu130"), ("ct200", "cu128", "2.11.0+cu128")):
        row = by_host[name]
        assert row["error"] is None
        status = row["result"]
        assert status["sglang"] == "0.5.17"
        assert status["torch"] == torch
        assert status["cuda_variant"] == variant
        assert status["python"] == "{}.{}.{}".format(*sys.version_info[:3])
        assert status["package_root"] == str(fleet.hosts[name].package_root)
        assert status["overlay"] is None and status["lock"] is None and status["journal_open"] is False


def test_status_table_names_every_host(inventory: Path, cli: Cli) -> None:
    out = cli("status", inventory=inventory)

    assert out.exit_code == 0, out.stderr
    assert "ct129" in out.stdout and "ct200" in out.stdout
    assert "cu130" in out.stdout and "cu128" in out.stdout


def test_status_selects_by_host_and_group(fleet: Fleet, tmp_path: Path, cli: Cli) -> None:
    inventory = fleet.write_inventory(tmp_path / "inventory.yaml", state_base=tmp_path / "state",
                                      hosts={"ct200": {"groups": ["canary"]}})

    assert list(cli("status", "--json", "--host", "ct200", inventory=inventory).rows()) == ["ct200"]
    assert list(cli("status", "--json", "--group", "eval", inventory=inventory).rows()) == ["ct129"]
    assert list(cli("status", "--json", "--all", inventory=inventory).rows()) == ["ct129", "ct200"]


def test_unknown_host_name_is_bad_input_listing_the_known_names(inventory: Path, cli: Cli) -> None:
    out = cli("status", "--json", "--host", "ct999", inventory=inventory)

    assert out.exit_code == 2
    assert out.stderr == ""
    error = out.json["error"]
    assert error["code"] == "invalid_input"
    assert "ct999" in error["message"]
    assert "ct129" in error["hint"] and "ct200" in error["hint"]

    human = cli("status", "--host", "ct999", inventory=inventory)
    assert human.exit_code == 2
    assert "ct999" in human.stderr and "ct129, ct200" in human.stderr


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port bound but never listening: connecting to it is refused, and nobody else can take it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def test_refused_port_is_a_row_with_the_error_not_a_crash(
    fleet: Fleet, tmp_path: Path, cli: Cli, closed_port: int
) -> None:
    ssh_config = fleet.write_ssh_config(tmp_path / "ssh_config", extra={"ctdead": closed_port})
    inventory = fleet.write_inventory(
        tmp_path / "inventory.yaml", state_base=tmp_path / "state", ssh={"config": str(ssh_config)},
        hosts={"ctdead": fleet.hosts["ct129"].inventory_entry(ssh="ctdead", state_dir=str(tmp_path / "dead"))},
    )

    out = cli("status", "--json", inventory=inventory)

    assert out.exit_code == 1  # a host is unreachable; the others still answered
    assert out.stderr == ""
    by_host = out.rows()
    assert by_host["ct129"]["result"]["sglang"] == "0.5.17"
    assert by_host["ct200"]["result"]["sglang"] == "0.5.17"
    dead = by_host["ctdead"]
    assert dead["result"] is None
    assert dead["error"]["code"] == "unreachable"
    assert f"127.0.0.1:{closed_port}" in dead["error"]["message"]
    assert not (tmp_path / "dead").exists()

    human = cli("status", "--host", "ctdead", inventory=inventory)
    assert human.exit_code == 1
    assert "ctdead" in human.stdout and "no" in human.stdout


def test_second_locker_is_refused_with_the_holders_name_and_status_shows_it(
    fleet: Fleet, inventory: Path, cli: Cli
) -> None:
    inv = load_inventory(str(inventory))
    alice = transport_for(inv.hosts["ct200"], inv.ssh, owner="alice")
    bob = transport_for(inv.hosts["ct200"], inv.ssh, owner="bob")
    try:
        assert alice.call("lock", {"owner": "alice@ws1 pid 1 (push)", "ttl_s": 600})["lock"]["owner"].startswith("alice")
        refused = bob.run_helper("lock", {"owner": "bob@ws2 pid 2 (push)"})
        assert not refused.ok
        error = refused.error()
        assert error.code == "locked"
        assert "alice@ws1 pid 1 (push)" in error.message
        assert error.details["holder"]["owner"] == "alice@ws1 pid 1 (push)"

        out = cli("status", "--json", inventory=inventory)
        assert out.exit_code == 3  # a locked host needs attention
        assert out.rows()["ct200"]["result"]["lock"] == "alice@ws1 pid 1 (push)"
        assert out.rows()["ct129"]["result"]["lock"] is None

        alice.call("unlock", {"owner": "alice@ws1 pid 1 (push)"})
        assert bob.call("lock", {"owner": "bob@ws2 pid 2 (push)"})["lock"]["owner"].startswith("bob")
    finally:
        alice.close()
        bob.close()


OLD_PYTHON_STANDIN = '''#!{python}
"""Stand-in for a host python 3.7 (a real one is rarely installed): runs `-c CODE` with 3.7's version facts."""
import sys
sys.version_info = (3, 7, 17, "final", 0)
sys.version = "3.7.17 (default, Jun  6 2023, 20:10:10) [GCC 12.2.0] (ddtree-deploy stand-in)"
sys.executable = __file__
code = sys.argv[sys.argv.index("-c") + 1]
exec(compile(code, "<string>", "exec"), {{"__name__": "__main__"}})
'''


def old_pythons(tmp_path: Path) -> list[Path]:
    """The stand-in always, plus any real python older than 3.8 this machine has (pyenv builds)."""
    standin = tmp_path / "python3.7"
    standin.write_text(OLD_PYTHON_STANDIN.format(python=sys.executable))
    standin.chmod(0o755)
    real = [p for p in sorted(Path("/root/.pyenv/versions").glob("*/bin/python"))
            if re.fullmatch(r"(2\.\d+|3\.[0-7])\.\d+", p.parent.parent.name)]
    return [standin, *real]


def test_python_older_than_3_8_gets_a_clear_error(fleet: Fleet, tmp_path: Path, cli: Cli) -> None:
    before = fleet.hosts["ct129"].digest()
    for python in old_pythons(tmp_path):
        inventory = fleet.write_inventory(tmp_path / "inventory.yaml", state_base=tmp_path / "state",
                                          hosts={"ct129": {"python": str(python)}})
        out = cli("status", "--json", "--host", "ct129", inventory=inventory)

        assert out.exit_code == 1, (python, out.stdout)
        error = out.rows()["ct129"]["error"]
        assert error["code"] == "python_too_old", (python, error)
        assert "older than 3.8" in error["message"]
        assert error["hint"]
    assert fleet.hosts["ct129"].digest() == before
    assert not (tmp_path / "state").exists()


def test_missing_python_is_a_row_naming_the_path(fleet: Fleet, tmp_path: Path, cli: Cli) -> None:
    missing = tmp_path / "no env" / "bin" / "python3"
    inventory = fleet.write_inventory(tmp_path / "inventory.yaml", state_base=tmp_path / "state",
                                      hosts={"ct200": {"python": str(missing)}})

    out = cli("status", "--json", inventory=inventory)

    assert out.exit_code == 1
    assert out.rows()["ct129"]["error"] is None
    error = out.rows()["ct200"]["error"]
    assert str(missing) in error["message"]


def test_status_as_a_separate_process_keeps_stderr_empty_with_json(inventory: Path) -> None:
    """The console entry point (`ddtree-deploy` is `ddtree_deploy.cli:main`) in its own process, as a user runs it."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DDTREE_")}
    out = subprocess.run([sys.executable, "-c", "from ddtree_deploy.cli import main; main()", "status", "--json",
                          "--inventory", str(inventory)], capture_output=True, text=True, env=env, check=False,
                         stdin=subprocess.DEVNULL, timeout=120)

    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr == ""
    assert [row["result"]["sglang"] for row in json.loads(out.stdout)["data"]["hosts"]] == ["0.5.17", "0.5.17"]
