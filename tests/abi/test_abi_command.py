"""`ddtree-deploy abi` on a local two-host fleet: the matrix, the JSON envelope, exit codes."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from ddtree_deploy.commands.abi import abi

OLD_DRIVER = ["NVIDIA H200, 570.86.15, 9.0"]


def app() -> typer.Typer:
    """The command alone (cli.py registers it among the others)."""
    application = typer.Typer()
    application.command("abi")(abi)
    application.command("noop")(lambda: None)  # two commands: `abi` is invoked by name, as in the CLI
    return application


@pytest.fixture
def fleet(tmp_path: Path, make_site: Callable[..., Path]) -> Callable[..., Path]:
    """inventory.yaml for ct129 (cu130) and ct200 (cu128) as local hosts, plus `extra` hosts."""
    def write(extra: dict[str, dict[str, str]] | None = None, ct200_dists: dict[str, tuple[str, list[str]]] | None = None
              ) -> Path:
        sites = {"ct129": make_site("2.11.0+cu130", "13.0"), "ct200": make_site("2.11.0+cu128", "12.8", ct200_dists)}
        hosts: dict[str, dict[str, str]] = {name: {"package_root": str(site)} for name, site in sites.items()}
        hosts.update(extra or {})
        path = tmp_path / "inventory.yaml"
        path.write_text(yaml.safe_dump({
            "defaults": {"transport": "local", "python": sys.executable, "state_dir": str(tmp_path / "state"),
                         "groups": ["eval"]},
            "hosts": hosts,
        }))
        return path

    return write


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app(), ["abi", *args])
    return result.exit_code, result.stdout, result.stderr


def test_json_matrix_flags_the_variant_and_a_driver_too_old_for_cu130(
        fleet: Callable[..., Path], nvidia_smi: Callable[..., Path]) -> None:
    nvidia_smi(OLD_DRIVER)
    code, out, err = invoke("--inventory", str(fleet()), "--json")
    assert (code, err) == (1, "")
    data = json.loads(out)["data"]
    assert data["hosts"] == ["ct129", "ct200"] and data["consistent"] is False
    rows = {row["field"]: row for row in data["rows"]}
    assert rows["cuda variant"] == {"field": "cuda variant", "values": {"ct129": "cu130", "ct200": "cu128"},
                                    "differs": True}
    assert rows["sglang"]["values"] == {"ct129": "0.5.17", "ct200": "0.5.17"} and not rows["sglang"]["differs"]
    assert rows["driver"]["values"] == {"ct129": "570.86.15", "ct200": "570.86.15"}
    ct129, ct200 = data["columns"]
    assert ct129["fingerprint"]["cuda_variant"] == "cu130" and ct200["fingerprint"]["torch_cuda"] == "12.8"
    assert (ct129["consistent"], ct200["consistent"]) == (False, True)
    errors = [p for p in ct129["problems"] if p["severity"] == "error"]
    assert [(p["field"], p["found"], p["required"]) for p in errors] == [("driver_version", "570.86.15", ">=580")]
    assert not [p for p in ct200["problems"] if p["severity"] == "error"]


def test_consistent_fleet_exits_zero_and_highlights_differences(fleet: Callable[..., Path],
                                                                no_nvidia_smi: None) -> None:
    code, out, err = invoke("--inventory", str(fleet()), "--group", "eval")
    assert code == 0, out + err
    assert "cu130" in out and "cu128" in out
    assert "cuda variant *" in out and "the hosts differ" in out
    assert "every host's stack is consistent" in out


def test_kernel_pinned_to_another_torch_fails_the_host(fleet: Callable[..., Path], no_nvidia_smi: None) -> None:
    inventory = fleet(ct200_dists={"sgl-kernel": ("0.3.9", ["torch==2.10.0"])})
    code, out, _ = invoke("--inventory", str(inventory), "--host", "ct200")
    assert code == 1
    assert "ct200: sgl-kernel.requires.torch: sgl-kernel 0.3.9 requires torch==2.10.0, host has torch 2.11.0+cu128" in out


def test_unreachable_host_is_a_column_not_a_crash(fleet: Callable[..., Path], tmp_path: Path,
                                                  no_nvidia_smi: None) -> None:
    inventory = fleet(extra={"ct300": {"python": str(tmp_path / "no-such-python")}})
    code, out, err = invoke("--inventory", str(inventory), "--all", "--json")
    assert (code, err) == (1, "")
    data = json.loads(out)["data"]
    ct300 = data["columns"][2]
    assert ct300["fingerprint"] is None and ct300["error"]["code"] == "python_not_found"
    assert {row["field"]: row for row in data["rows"]}["python"]["values"]["ct300"] is None


def test_deep_flag_reaches_the_host(fleet: Callable[..., Path], tmp_path: Path, make_site: Callable[..., Path],
                                    no_nvidia_smi: None) -> None:
    site = make_site("2.11.0+cu128", "12.8")
    (site / "torch" / "__init__.py").write_text("raise ImportError('libc10_cuda.so: cannot open shared object file')\n")
    inventory = fleet(extra={"broken": {"package_root": str(site)}})
    code, out, _ = invoke("--inventory", str(inventory), "--host", "broken", "--deep", "--json")
    assert code == 1
    [column] = json.loads(out)["data"]["columns"]
    assert column["fingerprint"]["deep"]["torch_imported"] is False
    assert "deep.torch" in [p["field"] for p in column["problems"]]


def test_unknown_host_is_bad_input(fleet: Callable[..., Path]) -> None:
    code, out, err = invoke("--inventory", str(fleet()), "--host", "ct999", "--json")
    assert (code, err) == (2, "")
    error = json.loads(out)["error"]
    assert error["code"] == "invalid_input" and "ct129" in error["hint"] and "ct200" in error["hint"]
