"""Playbooks: loading refuses what it cannot run; the runner rolls back only after a change, and always unlocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from ddtree_deploy import playbook, steps
from ddtree_deploy.errors import PlaybookError, ServiceError
from ddtree_deploy.hostrun import HostRun, NoArgs, RunOptions, StepDef, StepOutcome
from ddtree_deploy.inventory import HostSpec
from ddtree_deploy.transport import LocalTransport


@pytest.mark.parametrize("name", ["push", "rollback", "restart", "stop"])
def test_builtin_playbooks_load(name: str) -> None:
    book = playbook.builtin(name)
    assert book.steps and all(call.name in steps.STEPS for call in book.steps + book.on_failure)


def test_push_rolls_back_by_restore_restart_probe() -> None:
    book = playbook.builtin("push")
    assert [c.name for c in book.steps] == ["preflight", "plan", "reference", "snapshot", "apply", "restart", "probe"]
    assert [c.name for c in book.on_failure] == ["restore", "restart", "probe"]


@pytest.mark.parametrize(("text", "needle"), [
    ("steps:\n  - reboot: {}\n", "steps[0]: unknown step 'reboot'"),
    ("steps:\n  - snapshot: {reason: [1]}\n", "steps[0]: step snapshot: argument reason"),
    ("steps:\n  - restart: {if_changed: true, colour: red}\n", "argument colour: unknown key"),
    ("steps:\n  - {preflight: {}, plan: {}}\n", "a step is '- name: {args}'"),
    ("steps: []\non_failure:\n  - nope\n", "on_failure[0]: unknown step 'nope'"),
    ("steps: [\n", "malformed YAML"),
    ("hosts: all\nsteps: []\n", "unknown key 'hosts'"),
    ("- preflight\n", "playbook: top level must be a mapping"),
    ("name: x\n", "a playbook is a mapping with a 'steps:' list"),
    ("steps: [snapshot, apply]\n", "steps[1]: step apply needs plan, which no step before it gives"),
    ("steps: [plan, preflight]\n", "steps[0]: step plan needs fingerprint, which no step before it gives"),
    ("steps: [preflight, plan, snapshot, apply]\non_failure: [apply]\n", "on_failure[0]: step apply needs plan"),
])
def test_bad_playbooks_are_refused_naming_file_step_and_field(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "book.yaml"
    path.write_text(text)
    with pytest.raises(PlaybookError) as info:
        playbook.load_playbook(path)
    assert str(path) in str(info.value) and needle in str(info.value)


def test_an_order_error_says_which_step_gives_the_missing_fact(tmp_path: Path) -> None:
    path = tmp_path / "book.yaml"
    path.write_text("steps: [preflight, snapshot, apply, plan]\n")
    with pytest.raises(PlaybookError) as info:
        playbook.load_playbook(path)
    assert info.value.hint == "put plan before apply"


def test_every_step_needs_only_what_some_step_or_the_run_gives() -> None:
    given = set(playbook.RUN_INPUTS).union(*(step.gives for step in steps.STEPS.values()))
    assert all(step.needs <= given for step in steps.STEPS.values())


def test_a_step_needing_the_overlay_is_refused_without_one(tmp_path: Path) -> None:
    path = tmp_path / "book.yaml"
    path.write_text("steps: [preflight, plan]\n")
    book = playbook.load_playbook(path)
    playbook.require_inputs(book, given={"overlay"})
    with pytest.raises(PlaybookError) as info:
        playbook.require_inputs(book, given=set())
    assert str(info.value) == f"{path}: steps[1]: step plan needs overlay, which this run does not give"
    assert info.value.hint == "pass --overlay NAME[@VERSION]"


def test_a_hand_built_run_missing_a_fact_is_refused_by_the_step() -> None:
    host = HostSpec(name="h", transport="local", python="python3")
    run = HostRun(transport=LocalTransport(host), options=RunOptions())
    with pytest.raises(PlaybookError, match="step apply needs plan"):
        steps.apply(run, NoArgs())


def test_a_bare_step_name_means_no_arguments(tmp_path: Path) -> None:
    path = tmp_path / "book.yaml"
    path.write_text("steps:\n  - stop\n")
    assert [c.name for c in playbook.load_playbook(path).steps] == ["stop"]


def test_unknown_builtin_lists_the_known_ones() -> None:
    with pytest.raises(PlaybookError) as info:
        playbook.builtin("deploy-everything")
    assert "push" in info.value.hint and "rollback" in info.value.hint


class _Recorder:
    """Fake steps that record their calls; `fail` names the step that raises."""

    def __init__(self, fail: str | None, changes_at: str | None) -> None:
        self.calls: list[str] = []
        self.fail, self.changes_at = fail, changes_at

    def step(self, name: str) -> StepDef:
        def run(host_run: HostRun, args: BaseModel) -> StepOutcome:
            self.calls.append(name)
            if name == self.changes_at:
                host_run.changed = True
            if name == self.fail:
                raise ServiceError(f"{name} broke", code="server_exited")
            return StepOutcome(step=name, status="ok")
        return StepDef(fn=run, args=NoArgs)


def _play(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: str | None, changes_at: str | None = "b",
          no_rollback: bool = False) -> tuple[playbook.PlaybookReport, _Recorder, list[Any]]:
    recorder = _Recorder(fail, changes_at)
    monkeypatch.setattr(steps, "STEPS", {n: recorder.step(n) for n in ("a", "b", "c", "undo")})
    unlocked: list[Any] = []
    monkeypatch.setattr(steps, "release_lock", lambda run: unlocked.append(run))
    path = tmp_path / "book.yaml"
    path.write_text("steps: [a, b, c]\non_failure: [undo]\n")
    host = HostSpec(name="h", transport="local", python="python3")
    run = HostRun(transport=LocalTransport(host), options=RunOptions(no_rollback=no_rollback))
    return playbook.play(playbook.load_playbook(path), run), recorder, unlocked


def test_a_failure_after_a_change_plays_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, recorder, unlocked = _play(tmp_path, monkeypatch, fail="c")
    assert recorder.calls == ["a", "b", "c", "undo"]
    assert report.outcome == "rolled_back" and report.failed_step == "c" and report.reason == "c broke"
    assert len(unlocked) == 1


def test_a_failure_before_any_change_is_a_refusal_without_rollback(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    report, recorder, unlocked = _play(tmp_path, monkeypatch, fail="a")
    assert recorder.calls == ["a"] and report.outcome == "refused" and len(unlocked) == 1


def test_no_rollback_leaves_the_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, recorder, _ = _play(tmp_path, monkeypatch, fail="c", no_rollback=True)
    assert recorder.calls == ["a", "b", "c"] and report.outcome == "failed"


def test_a_clean_run_is_ok_and_unlocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, recorder, unlocked = _play(tmp_path, monkeypatch, fail=None)
    assert recorder.calls == ["a", "b", "c"] and report.outcome == "ok" and len(unlocked) == 1
