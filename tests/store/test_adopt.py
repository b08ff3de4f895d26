"""Drift the operator accepts: `diff --content` shows it against the store, `adopt` makes it the baseline.

Before `adopt`, drift pushed over with --force stayed drift: every later push needed --force again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store_helpers import OVERLAYS, LocalHost, only_result, run_and_kill, tree_state

from ddtree_deploy.output import ExitCode
from ddtree_deploy.protocol import DeployedState, LockController
from ddtree_deploy.remote import locks
from ddtree_deploy.transport import LocalTransport

SPEC_UTILS = "sglang/srt/speculative/spec_utils.py"  # not a file of mini's
SERVER_ARGS = "sglang/srt/server_args.py"  # patched by mini@0.1.0
EDIT = "# hand edit on the host\n"

Cli = Callable[..., Any]


def on(host: LocalHost, cli: Cli) -> Callable[..., Any]:
    """`run("push", ...)`: the CLI against `host`'s inventory, with --host sbx and --json."""
    def run(command: str, *args: str) -> Any:
        extra = ("--overlays", str(OVERLAYS)) if command == "push" else ()
        return cli(command, "--host", "sbx", "--json", *extra, *args, inventory=host.inventory)

    return run


def edit(host: LocalHost, rel: str) -> None:
    with open(host.site / rel, "a") as f:
        f.write(EDIT)


def deployed(host: LocalHost) -> DeployedState:
    state = locks.state(host.transport).deployed
    assert state is not None
    return state


def with_edit(tree: dict[str, Any], site: Path, rel: str) -> dict[str, Any]:
    """`tree` with `rel` as it is on disk now (same mode)."""
    return {**tree, rel: (hashlib.sha256((site / rel).read_bytes()).hexdigest(), tree[rel][1])}


def test_drift_is_shown_adopted_then_pushed_over_without_force_and_rolled_back_to(
        cli: Cli, sandbox_host: LocalHost) -> None:
    run, site = on(sandbox_host, cli), sandbox_host.site
    pristine = tree_state(site)
    first = run("push", "--overlay", "mini@0.1.0")
    assert first.exit_code == 0, first.stdout
    edit(sandbox_host, SPEC_UTILS)
    edit(sandbox_host, SERVER_ARGS)
    adopted = tree_state(site)

    refused = run("push", "--overlay", "mini@0.2.0")
    step = only_result(refused)["steps"][0]
    assert refused.exit_code == ExitCode.FAILED and step["code"] == "drift", step
    assert tree_state(site) == adopted

    shown = run("diff", "--content")
    files = {d["path"]: d for d in only_result(shown)["files"]}
    assert shown.exit_code == ExitCode.HOST_NEEDS_ATTENTION and set(files) == {SPEC_UTILS, SERVER_ARGS}
    for rel in (SPEC_UTILS, SERVER_ARGS):  # the overlay's own file against its post-image, which the store keeps
        assert files[rel]["diff"].startswith(f"--- a/{rel}\n+++ b/{rel}\n"), files[rel]
        assert "+" + EDIT in files[rel]["diff"] and files[rel]["content_note"] == ""
    human = cli("diff", "--host", "sbx", "--content", inventory=sandbox_host.inventory)
    assert f"+++ b/{SPEC_UTILS}" in human.stdout and "+" + EDIT.strip() in human.stdout

    done = run("adopt")
    result = only_result(done)
    message = result["steps"][-1]["message"]
    assert done.exit_code == 0 and result["outcome"] == "ok", result
    assert "adopted 2 drifted files" in message and "mini@0.1.0 now sits on it" in message
    assert tree_state(site) == adopted  # no package file changed
    state = deployed(sandbox_host)
    assert state.snapshot == state.base_snapshot == result["summary"]["adopted"]
    assert run("diff").exit_code == 0
    again = run("adopt")
    assert again.exit_code == 0 and only_result(again)["steps"][-1]["status"] == "noop"

    pushed = run("push", "--overlay", "mini@0.2.0")  # no --force
    assert pushed.exit_code == 0 and only_result(pushed)["outcome"] == "ok", pushed.stdout
    assert run("rollback").exit_code == 0
    assert tree_state(site) == adopted  # bit-exact to the adopted files
    assert run("rollback").exit_code == 0
    # The overlay is off, and what was adopted beside it stays: adopt's snapshot is the package it sat on.
    assert tree_state(site) == with_edit(pristine, site, SPEC_UTILS)
    assert run("diff").exit_code == 0


def test_with_nothing_deployed_adopt_records_the_installed_files_as_the_base(
        cli: Cli, sandbox_host: LocalHost) -> None:
    run = on(sandbox_host, cli)
    assert run("push", "--overlay", "mini@0.1.0").exit_code == 0
    assert run("rollback").exit_code == 0
    edit(sandbox_host, SPEC_UTILS)
    adopted = tree_state(sandbox_host.site)
    assert only_result(run("push", "--overlay", "mini@0.1.0"))["steps"][0]["code"] == "drift"

    done = run("adopt")
    assert done.exit_code == 0 and "it is the new base" in only_result(done)["steps"][-1]["message"]
    state = deployed(sandbox_host)
    assert state.overlay is None and state.snapshot == state.base_snapshot
    assert run("push", "--overlay", "mini@0.1.0").exit_code == 0
    assert run("rollback").exit_code == 0
    assert tree_state(sandbox_host.site) == adopted


def test_adopt_refuses_a_lock_of_another_and_an_open_journal_and_changes_nothing(
        cli: Cli, sandbox_host: LocalHost, tmp_path: Path) -> None:
    run, t = on(sandbox_host, cli), sandbox_host.transport
    assert run("push", "--overlay", "mini@0.1.0").exit_code == 0
    edit(sandbox_host, SPEC_UTILS)
    before = tree_state(sandbox_host.site), deployed(sandbox_host)

    other = LocalTransport(t.host, owner="someone-else")
    locks.lock(other, ttl_s=600, controller=LockController(host="elsewhere", pid=1))
    refused = run("adopt")
    assert refused.exit_code == ExitCode.HOST_NEEDS_ATTENTION
    assert only_result(refused)["steps"][0]["code"] == "locked"
    assert (tree_state(sandbox_host.site), deployed(sandbox_host)) == before
    locks.unlock(other)

    run_and_kill(lambda: run("push", "--overlay", "mini@0.2.0", "--force"), "journal_written", tmp_path)
    assert locks.state(t).journal is not None  # the killed push's lock is taken over: its controller is dead
    refused = run("adopt")
    assert refused.exit_code == ExitCode.HOST_NEEDS_ATTENTION
    assert only_result(refused)["steps"][0]["code"] == "journal_open"
    assert (tree_state(sandbox_host.site), deployed(sandbox_host)) == before


def test_adopt_needs_a_host_named(cli: Cli, inventory: Path) -> None:
    out = cli("adopt", "--json", inventory=inventory)
    assert out.exit_code == ExitCode.BAD_INPUT and out.stderr == ""
    assert "--host" in json.dumps(out.json["error"])
