"""Bad inventories through the CLI: one-line errors naming file, host and field, exit 2, hosts untouched."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from sshd_fleet import Fleet

Cli = Callable[..., Any]


def broken_inventories(fleet: Fleet, folder: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (inventory text, words the error must name besides the file)."""
    good = yaml.safe_load(fleet.write_inventory(folder / "good.yaml", state_base=folder / "state").read_text())
    unknown_host_key = yaml.safe_load(yaml.safe_dump(good))
    unknown_host_key["hosts"]["ct200"]["pyhton"] = "/usr/bin/python3"
    unknown_top_key = {**good, "hostz": {}}
    wrong_type = yaml.safe_load(yaml.safe_dump(good))
    wrong_type["hosts"]["ct129"]["groups"] = "eval"
    bad_service = yaml.safe_load(yaml.safe_dump(good))
    bad_service["hosts"]["ct129"]["service"] = {"kind": "process", "command": ["python3"], "port": 70000}
    return {
        "malformed": ("hosts:\n  ct129: {ssh: ct129\n  ct200: {ssh: ct200}\n", ["line", "YAML"]),
        "tab_indent": ("hosts:\n\tct129: {}\n", ["line"]),
        "unknown_host_key": (yaml.safe_dump(unknown_host_key), ["ct200", "pyhton"]),
        "unknown_top_key": (yaml.safe_dump(unknown_top_key), ["hostz"]),
        "wrong_type": (yaml.safe_dump(wrong_type), ["ct129", "groups"]),
        "bad_service_port": (yaml.safe_dump(bad_service), ["ct129", "service", "port"]),
        "not_a_mapping": ("- ct129\n- ct200\n", ["mapping"]),
    }


CASES = ["malformed", "tab_indent", "unknown_host_key", "unknown_top_key", "wrong_type", "bad_service_port",
         "not_a_mapping"]


@pytest.mark.parametrize("case", CASES)
def test_bad_inventory_is_one_line_naming_file_host_and_field(
    fleet: Fleet, tmp_path: Path, cli: Cli, case: str
) -> None:
    text, words = broken_inventories(fleet, tmp_path)[case]
    path = tmp_path / "inventory.yaml"
    path.write_text(text)
    before = {name: host.digest() for name, host in fleet.hosts.items()}

    out = cli("status", "--json", inventory=path)

    assert out.exit_code == 2, out.stdout
    assert out.stderr == ""
    error = out.json["error"]
    assert error["code"] == "inventory_invalid"
    assert "\n" not in error["message"]
    assert str(path) in error["message"]
    for word in words:
        assert word in error["message"], (word, error["message"])
    assert error["hint"]

    human = cli("status", inventory=path)
    assert human.exit_code == 2
    assert human.stdout == ""
    assert human.stderr.startswith("error: ") and str(path) in human.stderr.splitlines()[0]
    assert {name: host.digest() for name, host in fleet.hosts.items()} == before
    assert not (tmp_path / "state").exists()


def test_missing_inventory_names_the_path_and_the_ways_to_give_one(tmp_path: Path, cli: Cli) -> None:
    out = cli("status", "--json", inventory=tmp_path / "nowhere.yaml")

    assert out.exit_code == 2
    assert str(tmp_path / "nowhere.yaml") in out.json["error"]["message"]
    assert "--inventory" in out.json["error"]["hint"]
