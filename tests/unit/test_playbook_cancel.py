"""Ctrl-C in the playbook runner: checked between steps, never inside one; after a change it rolls back."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from pydantic import BaseModel

from ddtree_deploy import playbook, steps
from ddtree_deploy.hostrun import HostRun, NoArgs, RunOptions, StepDef, StepOutcome
from ddtree_deploy.inventory import HostSpec
from ddtree_deploy.transport import LocalTransport


def _play(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, changes_at: str | None) -> tuple[playbook.PlaybookReport,
                                                                                             list[str]]:
    """Steps a, b, c (undo on failure); Ctrl-C comes while `a` runs, which changes the host if `changes_at` is a."""
    calls: list[str] = []
    cancel = threading.Event()

    def step(name: str) -> StepDef:
        def run(host_run: HostRun, _args: BaseModel) -> StepOutcome:
            calls.append(name)
            if name == "a":
                host_run.changed = changes_at == "a"
                cancel.set()  # the step itself runs to its end
            return StepOutcome(step=name, status="ok")
        return StepDef(fn=run, args=NoArgs)

    monkeypatch.setattr(steps, "STEPS", {n: step(n) for n in ("a", "b", "c", "undo")})
    monkeypatch.setattr(steps, "release_lock", lambda run: None)
    path = tmp_path / "book.yaml"
    path.write_text("steps: [a, b, c]\non_failure: [undo]\n")
    run = HostRun(transport=LocalTransport(HostSpec(name="h", transport="local", python="python3")),
                  options=RunOptions())
    return playbook.play(playbook.load_playbook(path), run, cancel), calls


def test_ctrl_c_after_a_change_stops_before_the_next_step_and_plays_on_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, calls = _play(tmp_path, monkeypatch, changes_at="a")
    assert calls == ["a", "undo"]  # the recovery runs although the flag stays set
    assert report.outcome == "rolled_back" and report.failed_step == "b" and report.reason == "interrupted (Ctrl-C)"
    assert [(s.step, s.status, s.code) for s in report.steps] == [("a", "ok", None), ("b", "failed", "interrupted")]


def test_ctrl_c_before_any_change_is_an_interrupted_outcome_without_rollback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    report, calls = _play(tmp_path, monkeypatch, changes_at=None)
    assert calls == ["a"] and report.outcome == "interrupted" and report.recovery == []
