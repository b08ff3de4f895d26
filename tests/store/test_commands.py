"""The store's commands end to end: `overlay list|check`, `snapshots`, `diff` (exit codes, JSON envelope, stderr)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import typer
from store_helpers import OVERLAYS, local_transport, tree_state
from typer.testing import CliRunner

from ddtree_deploy.catalog import load_overlay
from ddtree_deploy.commands import diff, overlay, snapshots
from ddtree_deploy.errors import PreflightError, UsageError
from ddtree_deploy.output import ExitCode, exit_code_for
from ddtree_deploy.remote import locks, store, transactions
from ddtree_deploy.steps import plan_for_host

SPEC_INFO = "sglang/srt/speculative/spec_info.py"


def app() -> typer.Typer:
    """The store's commands registered as cli.py registers them."""
    root = typer.Typer()
    root.command("snapshots")(snapshots.snapshots)
    root.command("diff")(diff.diff)
    root.add_typer(overlay.app, name="overlay")
    return root


def run(*args: str) -> tuple[int, dict[str, Any], str]:
    result = CliRunner().invoke(app(), list(args), catch_exceptions=False)
    return result.exit_code, json.loads(result.stdout), result.stderr


def test_overlay_list_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no ./overlays here: ddtree comes from the built-ins
    code, out, err = run("overlay", "list", "--overlays", str(OVERLAYS), "--json")
    assert (code, err) == (0, "")
    rows = [(o["name"], o["version"], o["bases"], o["inherits"], o["origin"]) for o in out["data"]["overlays"]]
    assert [row for row in rows if row[0] == "mini"] == [
        ("mini", "0.1.0", ["0.5.17"], None, "--overlays"), ("mini", "0.2.0", ["0.5.17"], "0.1.0", "--overlays")]
    assert {row[4] for row in rows if row[0] == "ddtree"} == {"built-in"}
    assert [f["origin"] for f in out["data"]["folders"]] == ["--overlays", "built-in"]


def test_overlay_check_reports_conflicts_and_bad_yaml_with_exit_codes(tmp_path: Path) -> None:
    folder = tmp_path / "overlays"
    shutil.copytree(OVERLAYS, folder)
    code, out, _ = run("overlay", "check", "mini@0.1.0", "--overlays", str(folder), "--json")
    assert code == 0 and out["data"]["ok"] and out["data"]["checks"][0]["bases"][0]["compiled"] == 3
    diff_file = folder / f"mini/0.1.0/patches/0.5.17/{SPEC_INFO}.diff"
    diff_file.write_text(diff_file.read_text().replace(" def is_dflash(self)", " def is_dflash_x(self)"))
    code, out, err = run("overlay", "check", "--overlays", str(folder), "--json")  # every version
    assert (code, err) == (ExitCode.FAILED, "")
    checks = {f'{c["overlay"]}@{c["version"]}': c for c in out["data"]["checks"]}
    assert checks["mini@0.2.0"]["ok"] is False  # it inherits 0.1.0's spec_info patch
    assert not checks["mini@0.1.0"]["ok"] and checks["ddtree@0.2.2"]["ok"]
    conflict = checks["mini@0.1.0"]["bases"][0]["conflicts"][0]
    assert (conflict["file"], conflict["hunk"]) == (SPEC_INFO, 1)
    (folder / "mini/0.1.0/overlay.yaml").write_text("name: [mini\n")
    code, out, err = run("overlay", "check", "mini@0.1.0", "--overlays", str(folder), "--json")
    assert (code, err) == (ExitCode.BAD_INPUT, "") and out["error"]["code"] == "overlay_invalid"
    assert "malformed YAML" in out["error"]["message"]


def test_snapshots_and_diff_over_a_local_host(inventory: Path, site: Path, tmp_path: Path) -> None:
    t = local_transport(site, tmp_path / "state")
    code, out, _ = run("diff", "--inventory", str(inventory), "--json")
    assert code == 0 and out["data"]["hosts"][0]["result"]["baseline"] is None
    the_plan = plan_for_host(t, load_overlay("mini@0.1.0", OVERLAYS), "0.5.17")
    taken = store.snapshot(t, "pre-push")
    transactions.apply(t, the_plan.helper_args(taken.id))

    code, out, err = run("snapshots", "--inventory", str(inventory), "--json")
    row = out["data"]["hosts"][0]["result"]
    assert (code, err) == (0, "") and row["deployed"] == "mini@0.1.0" and row["rollback_target"] == taken.id
    assert [s["id"] for s in row["snapshots"]] == [taken.id]

    code, out, _ = run("diff", "--inventory", str(inventory), "--json")
    assert code == 0 and out["data"]["hosts"][0]["result"]["clean"]
    with open(site / SPEC_INFO, "a") as f:
        f.write("# hand edit\n")
    code, out, err = run("diff", "--inventory", str(inventory), "--json")
    result = out["data"]["hosts"][0]["result"]
    assert (code, err) == (ExitCode.HOST_NEEDS_ATTENTION, "")
    assert [(d["path"], d["kind"]) for d in result["files"]] == [(SPEC_INFO, "modified")]


def test_unknown_snapshot_is_bad_input_and_changes_nothing(site: Path, tmp_path: Path) -> None:
    t = local_transport(site, tmp_path / "state")
    store.snapshot(t, "r")
    before = tree_state(site)
    with pytest.raises(UsageError) as err:
        transactions.restore(t, "20990101T000000Z-00000000")
    assert err.value.code == "unknown_snapshot" and exit_code_for(err.value) == ExitCode.BAD_INPUT
    assert "known snapshots" in err.value.hint and tree_state(site) == before


def test_a_deployed_record_from_another_sglang_release_is_not_trusted(site: Path, tmp_path: Path) -> None:
    t = local_transport(site, tmp_path / "state")
    overlay = load_overlay("mini@0.1.0", OVERLAYS)
    transactions.apply(t, plan_for_host(t, overlay, "0.5.17").helper_args(store.snapshot(t, "pre-push").id))
    deployed = locks.state(t).deployed
    assert deployed is not None and deployed.base == "0.5.17"
    assert plan_for_host(t, overlay, "0.5.17", deployed=deployed).noop
    reinstalled = deployed.model_copy(update={"base": "0.5.16"})  # as if pip replaced sglang under the overlay
    with pytest.raises(PreflightError) as err:  # base-snapshot bytes of another release are never patched
        plan_for_host(t, overlay, "0.5.17", deployed=reinstalled)
    assert err.value.code == "preimage_mismatch"
