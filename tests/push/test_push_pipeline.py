"""The whole push on a sandbox host: fail fast, roll back bit-exact, probes, --no-rollback, playbooks, crashes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pip
import pytest
import yaml

from sandbox.hosts import release_wheel

if TYPE_CHECKING:
    from conftest import Fleet


def host_row(envelope: dict[str, Any]) -> dict[str, Any]:
    rows = envelope["data"]["hosts"]  # type: ignore[index]
    assert len(rows) == 1
    return rows[0]


def steps_of(result: dict[str, Any], phase: str = "steps") -> dict[str, str]:
    return {s["step"]: s["status"] for s in result[phase]}


def test_push_applies_then_second_push_is_a_noop_writing_nothing(fleet: Fleet) -> None:
    before = fleet.package_digest()
    code, out = fleet.json("push", "--host", "ct200", "--overlay", "ddtree@0.1.0")
    result = host_row(out)["result"]
    assert code == 0 and result["outcome"] == "ok", result
    assert steps_of(result) == {s: "ok" for s in
                                ("preflight", "plan", "reference", "snapshot", "apply", "restart", "probe")}
    applied = fleet.package_digest()
    assert applied != before
    state_dir_mtimes = _tree_mtimes(fleet.root / "hosts" / "ct200" / "state")
    code, out = fleet.json("push", "--host", "ct200", "--overlay", "ddtree@0.1.0")
    assert code == 0 and host_row(out)["result"]["outcome"] == "noop"
    assert fleet.package_digest() == applied
    # Bookkeeping may move (the lock, the history line, the store's stat cache); the record may not.
    bookkeeping = ("lock", "history.jsonl", "statcache.json")
    changed = {p for p, m in _tree_mtimes(fleet.root / "hosts" / "ct200" / "state").items()
               if state_dir_mtimes.get(p) != m and not p.endswith(bookkeeping)}
    assert not changed, f"a no-op push wrote {changed}"


def test_dry_run_prints_the_diff_and_changes_nothing(fleet: Fleet) -> None:
    before = fleet.package_digest()
    proc = fleet.cli("push", "--host", "ct200", "--overlay", "lossy", "--dry-run")
    assert proc.returncode == 0, proc.stdout
    assert "+++ b/sglang/srt/speculative/lossy_marker.py" in proc.stdout
    assert fleet.package_digest() == before


@pytest.mark.parametrize(("overlay", "why"), [
    ("broken", "server_fatal_log"),  # the package does not compile: Traceback at start-up
    ("crashy", None),  # the server exits shortly after it starts
    ("hangs", "server_timeout"),  # never ready
    ("lossy", "probe_failed"),  # answers differ from the reference
    ("badarg", None),  # server args the host's ServerArgs does not know: a usage error, exit 2
])
def test_a_failed_push_rolls_back_bit_exact_and_healthy(fleet: Fleet, overlay: str, why: str | None) -> None:
    before = fleet.package_digest()
    code, out = fleet.json("push", "--host", "ct200", "--overlay", overlay)
    result = host_row(out)["result"]
    assert code == 1 and result["outcome"] == "rolled_back", result
    failed = next(s for s in result["steps"] if s["status"] == "failed")
    if why is not None:
        assert failed["code"] == why, failed
    assert steps_of(result, "recovery") == {"restore": "ok", "restart": "ok", "probe": "ok"}
    assert result["healthy"] is True
    assert fleet.package_digest() == before
    if overlay == "badarg":
        assert "unrecognized arguments: --speculative-ddtree-budget" in json.dumps(failed), failed
    if overlay == "lossy":  # the rolled-back server answers the overlay's own prompt as before the push
        probes = result["summary"]["probes"]
        own = [p for p in probes if p["name"] == "lossless (1 prompt, 32 tokens)"]  # the inventory's has 3
        assert [p["status"] for p in own] == ["pass"], [(p["name"], p["status"]) for p in probes]
    code, status = fleet.json("status")
    assert code == 0 and host_row(status)["result"]["server"].startswith("healthy")


def test_a_crash_at_start_is_reported_with_the_log_tail(fleet: Fleet) -> None:
    proc = fleet.cli("push", "--host", "ct200", "--overlay", "broken")
    assert proc.returncode == 1
    assert "SyntaxError" in proc.stdout and "host is now healthy" in proc.stdout


def test_no_rollback_leaves_the_failure_for_status_and_rollback(fleet: Fleet) -> None:
    before = fleet.package_digest()
    code, out = fleet.json("push", "--host", "ct200", "--overlay", "broken", "--no-rollback")
    assert code == 3 and host_row(out)["result"]["outcome"] == "failed"
    assert fleet.package_digest() != before
    code, status = fleet.json("status")
    row = host_row(status)["result"]
    assert code == 3 and row["overlay"] == "broken@0.0.1" and row["server"].startswith("unhealthy")
    code, out = fleet.json("rollback", "--host", "ct200")
    assert code == 0 and host_row(out)["result"]["outcome"] == "ok"
    assert fleet.package_digest() == before
    assert fleet.json("status")[0] == 0


def test_a_port_taken_by_another_process_fails_and_says_so(fleet: Fleet) -> None:
    port = _service_port(fleet)
    assert fleet.cli("stop", "--host", "ct200").returncode == 0
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", port))
    squatter.listen()
    try:
        code, out = fleet.json("push", "--host", "ct200", "--overlay", "lossy")
        result = host_row(out)["result"]
        assert code == 3 and result["outcome"] == "failed" and result["healthy"] is False
        assert "port" in result["reason"] and str(port) in result["reason"]
    finally:
        squatter.close()
    code, out = fleet.json("rollback", "--host", "ct200")
    assert code == 0, out


def test_push_and_rollback_playbooks_run_from_their_yaml(fleet: Fleet) -> None:
    repo = Path(__file__).resolve().parents[2]
    before = fleet.package_digest()
    code, out = fleet.json("play", str(repo / "playbooks" / "push.yaml"), "--host", "ct200",
                           "--overlay", "lossy", "--no-rollback")
    assert code == 3 and host_row(out)["result"]["failed_step"] == "probe"
    code, out = fleet.json("play", str(repo / "playbooks" / "rollback.yaml"), "--host", "ct200")
    assert code == 0 and steps_of(host_row(out)["result"])["restore"] == "ok"
    assert fleet.package_digest() == before


def test_a_dry_run_of_a_playbook_without_a_plan_ends_before_its_first_change(fleet: Fleet, tmp_path: Path) -> None:
    book = tmp_path / "bench-like.yaml"
    book.write_text("steps:\n  - preflight: {}\n  - snapshot: {reason: pre-bench}\n  - restart: {}\n")
    before, (_, listed) = fleet.package_digest(), fleet.json("snapshots", "--host", "ct200")
    code, out = fleet.json("play", str(book), "--host", "ct200", "--dry-run")
    result = host_row(out)["result"]
    assert code == 0 and result["outcome"] == "dry_run", result
    assert list(steps_of(result)) == ["preflight"]  # the snapshot and the restart never ran
    assert fleet.package_digest() == before and fleet.json("snapshots", "--host", "ct200")[1] == listed
    assert host_row(fleet.json("status")[1])["result"]["lock"] is None


def test_an_unknown_step_is_a_load_error_before_any_host_is_touched(fleet: Fleet, tmp_path: Path) -> None:
    book = tmp_path / "mine.yaml"
    book.write_text("steps:\n  - preflight: {}\n  - reboot: {}\n")
    proc = fleet.cli("play", str(book), "--host", "ct200")
    assert proc.returncode == 2 and "unknown step 'reboot'" in proc.stderr and str(book) in proc.stderr
    book.write_text("steps:\n  - snapshot: {reason: pre, colour: red}\n")
    proc = fleet.cli("play", str(book), "--host", "ct200", "--json")
    assert proc.returncode == 2 and '"playbook_invalid"' in proc.stdout and "colour" in proc.stdout


@pytest.mark.parametrize(("text", "args", "needle"), [
    ("steps:\n  - preflight: {}\n  - snapshot: {}\n  - apply: {}\n", (),
     "steps[2]: step apply needs plan, which no step before it gives"),
    ("steps:\n  - preflight: {}\n  - plan: {}\n", (), "steps[1]: step plan needs overlay, which this run does not give"),
])
def test_a_playbook_whose_order_cannot_work_is_refused_before_any_host_is_touched(
        fleet: Fleet, tmp_path: Path, text: str, args: tuple[str, ...], needle: str) -> None:
    book = tmp_path / "order.yaml"
    book.write_text(text)
    before = fleet.package_digest()
    proc = fleet.cli("play", str(book), "--host", "ct200", *args)
    assert proc.returncode == 2 and f"{book}: {needle}" in proc.stderr, proc.stderr
    assert fleet.package_digest() == before
    code, status = fleet.json("status")
    assert code == 0 and host_row(status)["result"]["lock"] is None


@pytest.mark.parametrize("point", ["journal_written", "file_written:1", "state_written"])
def test_a_controller_killed_mid_push_leaves_a_journal_that_rollback_undoes(fleet: Fleet, tmp_path: Path,
                                                                          point: str) -> None:
    code, out = fleet.json("rollback", "--host", "ct200")  # start from the pristine package
    assert code == 0, out
    before = fleet.package_digest()
    signal_file = tmp_path / "paused"
    env = {**fleet.env, "DDTREE_TEST_PAUSE_AT": point, "DDTREE_TEST_PAUSE_SIGNAL": str(signal_file)}
    proc = subprocess.Popen([sys.executable, "-m", "ddtree_deploy.cli", "push", "--host", "ct200",
                             "--overlay", "ddtree@0.1.0"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(signal_file, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the controller and the helper it runs, mid-transaction
    proc.wait()
    code, status = fleet.json("status")
    assert code == 3 and host_row(status)["result"]["journal_open"] is True
    code, out = fleet.json("push", "--host", "ct200", "--overlay", "ddtree@0.1.0")
    failed = host_row(out)["result"]["steps"][0]
    assert code == 3 and failed["code"] == "journal_open" and "rollback" in failed["hint"]
    code, out = fleet.json("rollback", "--host", "ct200")
    assert code == 0, out
    assert fleet.package_digest() == before
    assert fleet.json("status")[0] == 0


def _wait_for(signal_file: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while not signal_file.exists():
        assert proc.poll() is None, "push ended before reaching the pause point"
        assert time.monotonic() < deadline, "push never reached the pause point"
        time.sleep(0.05)


def _service_port(fleet: Fleet) -> int:
    import yaml

    return int(yaml.safe_load(fleet.inventory.read_text())["hosts"]["ct200"]["service"]["port"])


def _tree_mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_history_tells_what_was_done_on_the_host_and_from_here(fleet: Fleet) -> None:
    code, out = fleet.json("push", "--host", "ct200", "--overlay", "lossy")
    assert code == 1
    code, out = fleet.json("history", "--host", "ct200", "-n", "50")
    assert code == 0
    data = out["data"]
    (row,) = data["hosts"]["hosts"]  # type: ignore[index]
    ops = [e["op"] for e in row["result"]["events"]]
    assert {"apply", "restore", "service_start", "service_stop"} <= set(ops), ops
    assert data["audit"][-1]["command"] == "push" and data["audit"][-1]["hosts"] == {"ct200": "rolled_back"}


def test_rollback_to_an_overlay_whose_manifest_is_gone_still_restores(fleet: Fleet, tmp_path: Path) -> None:
    assert fleet.json("rollback", "--host", "ct200")[0] == 0
    pristine = fleet.package_digest()
    # ddtree 0.1.0 under a name only this folder has (the built-in ddtree is always found).
    mine = tmp_path / "mine"
    assert fleet.cli("overlay", "export", "ddtree@0.1.0", str(mine / "gone" / "0.1.0")).returncode == 0
    manifest = mine / "gone" / "0.1.0" / "overlay.yaml"
    manifest.write_text(manifest.read_text().replace("name: ddtree", "name: gone"))
    assert fleet.json("push", "--host", "ct200", "--overlay", "gone@0.1.0", "--overlays", str(mine))[0] == 0
    on_010 = fleet.package_digest()
    assert fleet.json("push", "--host", "ct200", "--overlay", "lossy", "--no-rollback")[0] == 3
    empty = tmp_path / "overlays"
    empty.mkdir()
    proc = fleet.cli("rollback", "--host", "ct200", "--json", extra_env={"DDTREE_OVERLAYS": str(empty)})
    result = json.loads(proc.stdout)["data"]["hosts"][0]["result"]
    assert proc.returncode == 0 and result["outcome"] == "ok", result
    restore = next(s for s in result["steps"] if s["step"] == "restore")
    assert "gone@0.1.0" in restore["message"] and "inventory's args only" in restore["message"]
    assert fleet.package_digest() == on_010
    assert fleet.json("rollback", "--host", "ct200")[0] == 0
    assert fleet.package_digest() == pristine


def test_rollback_is_not_refused_by_a_stack_broken_since_the_push(fleet: Fleet) -> None:
    """Rollback is the way out: a torch pin broken after the push (someone's pip install) is reported,
    not a reason to keep the overlay; the fingerprint check against the snapshot still applies."""
    assert fleet.json("rollback", "--host", "ct200")[0] == 0
    pristine = fleet.package_digest()
    assert fleet.json("push", "--host", "ct200", "--overlay", "ddtree@0.1.0")[0] == 0
    (metadata,) = fleet.package_root.glob("sglang_kernel-*.dist-info/METADATA")
    original = metadata.read_text()
    metadata.write_text(original.replace("Requires-Dist: torch==2.11.0", "Requires-Dist: torch==2.10.0"))
    try:
        refused_push = host_row(fleet.json("push", "--host", "ct200", "--overlay", "ddtree@0.2.2")[1])
        assert "sglang-kernel" in json.dumps(refused_push)  # a push still refuses the broken stack
        code, out = fleet.json("rollback", "--host", "ct200")
        result = host_row(out)["result"]
        assert code == 0 and result["outcome"] == "ok", result
        preflight = next(s for s in result["steps"] if s["step"] == "preflight")
        assert "torch" in preflight["message"] and "(reported, not blocking)" in preflight["message"]
        assert fleet.package_digest() == pristine
        assert fleet.json("restart", "--host", "ct200")[0] != 0  # starting a server on it is refused
        assert fleet.json("stop", "--host", "ct200")[0] == 0  # stopping one (freeing the GPU) never is
    finally:
        metadata.write_text(original)
        assert fleet.json("restart", "--host", "ct200")[0] == 0


def test_pip_reinstalling_sglang_under_an_overlay_removes_its_files_and_status_explains(
        fleet: Fleet, tmp_path: Path) -> None:
    """The push lists its files in pip's RECORD, so real pip (this machine's, run by the host's python)
    uninstalling sglang leaves none of them behind; `status` then says the overlay's files changed
    (exit 3) and `rollback` undoes it all."""
    before = fleet.package_digest()
    code, out = fleet.json("push", "--host", "ct200", "--overlay", "ddtree@0.1.0")
    assert code == 0 and host_row(out)["result"]["outcome"] == "ok", out
    code, out = fleet.json("status", "--host", "ct200")
    assert code == 0 and host_row(out)["result"]["notes"] == [], out

    speculative = fleet.package_root / "sglang" / "srt" / "speculative"
    assert list(speculative.glob("ddtree*.py")), "the overlay created no ddtree module"
    host_pip(fleet, tmp_path, "uninstall", "-y", "sglang")
    left = [p for p in (fleet.package_root / "sglang").rglob("*") if p.is_file() and "__pycache__" not in p.parts] \
        if (fleet.package_root / "sglang").exists() else []
    assert left == [], f"pip uninstall left {left[:5]}"
    host_pip(fleet, tmp_path, "install", "--no-deps", "--no-compile", str(release_wheel()))
    assert not list(speculative.glob("ddtree*.py"))

    code, out = fleet.json("status", "--host", "ct200")
    status = host_row(out)["result"]
    assert code == 3 and status["needs_attention"], out
    assert any("files changed since the push" in note for note in status["notes"]), status
    code, out = fleet.json("diff", "--host", "ct200")
    kinds = {d["path"]: d["kind"] for d in host_row(out)["result"]["files"]}
    assert kinds["sglang/srt/speculative/ddtree_utils.py"] == "missing", kinds
    code, out = fleet.json("rollback", "--host", "ct200")
    assert code == 0, out
    assert fleet.package_digest() == before
    code, out = fleet.json("status", "--host", "ct200")
    assert code == 0 and host_row(out)["result"]["notes"] == [], out


def host_pip(fleet: Fleet, tmp_path: Path, *args: str) -> None:
    """This machine's pip, run by the host's own python (the host's venv has no pip of its own)."""
    only_pip = tmp_path / "pip-only"
    if not only_pip.exists():
        only_pip.mkdir()
        (only_pip / "pip").symlink_to(Path(pip.__file__).parent)
    python = yaml.safe_load(fleet.inventory.read_text())["hosts"]["ct200"]["python"]
    done = subprocess.run([python, "-m", "pip", *args], env={**os.environ, "PYTHONPATH": str(only_pip)},
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_version_that_changes_only_its_server_args_is_deployed_not_a_noop(fleet: Fleet, tmp_path: Path) -> None:
    """Equal files are not equal deployments: 0.1.1 lands 0.1.0's bytes with other launch arguments, so its
    push records 0.1.1, restarts with its args and probes, where "already applied" would leave 0.1.0's."""
    assert fleet.json("rollback", "--host", "ct200")[0] == 0
    mine = tmp_path / "mine"
    assert fleet.cli("overlay", "export", "ddtree@0.1.0", str(mine / "dd" / "0.1.0")).returncode == 0
    manifest = mine / "dd" / "0.1.0" / "overlay.yaml"
    manifest.write_text(manifest.read_text().replace("name: ddtree", "name: dd"))
    (mine / "dd" / "0.1.1").mkdir()
    (mine / "dd" / "0.1.1" / "overlay.yaml").write_text(
        "name: dd\nversion: 0.1.1\ninherits: 0.1.0\nserver: {args: [--speculative-ddtree-budget, '32']}\n"
        "probes: [{kind: server_info, expect: {speculative_ddtree_budget: 32}}]\n")
    assert fleet.json("push", "--host", "ct200", "--overlay", "dd@0.1.0", "--overlays", str(mine))[0] == 0
    on_010 = fleet.package_digest()
    code, out = fleet.json("push", "--host", "ct200", "--overlay", "dd@0.1.1", "--overlays", str(mine))
    result = host_row(out)["result"]
    assert code == 0 and result["outcome"] == "ok", result
    assert steps_of(result)["restart"] == "ok" and steps_of(result)["probe"] == "ok"
    assert fleet.package_digest() == on_010  # the same bytes
    status = host_row(fleet.json("status", "--host", "ct200")[1])["result"]
    assert status["overlay"] == "dd@0.1.1" and "32" in status["launch_args"], status
    code, out = fleet.json("push", "--host", "ct200", "--overlay", "dd@0.1.1", "--overlays", str(mine))
    assert code == 0 and host_row(out)["result"]["outcome"] == "noop"  # now it is what the host records
    assert fleet.json("rollback", "--host", "ct200")[0] == 0
