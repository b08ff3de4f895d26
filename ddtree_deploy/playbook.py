"""Playbooks: named step sequences loaded from YAML, and the runner that plays one on one host.

A playbook is `steps:` (each `- step_name: {args}`) plus an `on_failure:` sequence. Unknown steps,
unknown or ill-typed arguments, and an order in which a step needs a fact no step before it gives
(`apply` before `plan`) are load-time errors naming the file, the step and the field or fact; a step
that needs what only the run gives (an overlay) is refused by `require_inputs` before any host is
touched. The runner plays `steps` in order; when one fails it plays `on_failure` (unless the run says
`no_rollback`), always releases the host lock, and returns a `PlaybookReport` with every step's
outcome. `push` and `rollback` are the built-in playbooks under `playbooks/`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ddtree_deploy import steps
from ddtree_deploy.errors import DeployError, PlaybookError
from ddtree_deploy.hostrun import Fact, HostRun, StepOutcome
from ddtree_deploy.resources import builtin_dir
from ddtree_deploy.yamlfile import first_problem, read_mapping

#: The built-in playbooks: package data (the repository's playbooks/, see resources.py).
BUILTIN_DIR = builtin_dir("playbooks")
INTERRUPTED = "interrupted (Ctrl-C)"
#: facts the run itself gives before any step, and how the operator gives each
RUN_INPUTS: dict[Fact, str] = {"overlay": "pass --overlay NAME[@VERSION]"}


class StepCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    args: BaseModel


class Playbook(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    path: str
    description: str = ""
    steps: list[StepCall]
    on_failure: list[StepCall] = Field(default_factory=list)


class PlaybookReport(BaseModel):
    """What happened on one host: every step's outcome, which one failed, and the host's state after."""

    playbook: str
    host: str
    outcome: str  # ok | noop | dry_run | rolled_back | failed | refused | interrupted (before any change)
    failed_step: str | None = None
    reason: str = ""
    steps: list[StepOutcome]
    recovery: list[StepOutcome] = Field(default_factory=list)
    healthy: bool | None = None
    summary: dict[str, Any] = Field(default_factory=dict)


def builtin(name: str) -> Playbook:
    """A built-in playbook by name (package data, from the repository's playbooks/: push, rollback, restart, stop,
    prune)."""
    path = BUILTIN_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml")))
        raise PlaybookError(f"{name}: no such playbook file, nor a built-in one", hint=f"built-ins: {known}")
    return load_playbook(path)


def load_playbook(path: Path) -> Playbook:
    """Read and validate a playbook file; any error names the file, the step and the field."""
    raw = read_mapping(path, PlaybookError, what="playbook", read_hint="check the path")
    if not isinstance(raw.get("steps"), list):
        raise PlaybookError(f"{path}: a playbook is a mapping with a 'steps:' list", hint="see playbooks/push.yaml")
    unknown = set(raw) - {"name", "description", "steps", "on_failure"}
    if unknown:
        raise PlaybookError(f"{path}: unknown key {sorted(unknown)[0]!r}",
                            hint="allowed: name, description, steps, on_failure")
    book = Playbook(
        name=str(raw.get("name") or path.stem),
        path=str(path),
        description=str(raw.get("description") or ""),
        steps=[_step_call(path, "steps", i, item) for i, item in enumerate(raw["steps"])],
        on_failure=[_step_call(path, "on_failure", i, item) for i, item in enumerate(raw.get("on_failure") or [])],
    )
    _check_order(path, "steps", book.steps)
    _check_order(path, "on_failure", book.on_failure)  # a failure can come at any step: it relies on itself alone
    return book


def _check_order(path: Path, section: str, calls: list[StepCall]) -> None:
    """Every fact a step needs is given by a step before it (or by the run: see `require_inputs`)."""
    given: set[Fact] = set(RUN_INPUTS)
    for index, call in enumerate(calls):
        step = steps.STEPS[call.name]
        missing = sorted(step.needs - given)
        if missing:
            givers = [name for name, other in steps.STEPS.items() if missing[0] in other.gives]
            raise PlaybookError(f"{path}: {section}[{index}]: step {call.name} needs {missing[0]}, "
                                "which no step before it gives",
                                hint=f"put {' or '.join(givers) or 'a step that gives it'} before {call.name}")
        given |= step.gives


def require_inputs(book: Playbook, given: set[Fact]) -> None:
    """Refuse `book` if a step needs what this run does not give (a `plan` step, and no overlay named).

    Raises:
        PlaybookError: naming the file, the step and the input, with how to give it.
    """
    for section, calls in (("steps", book.steps), ("on_failure", book.on_failure)):
        for index, call in enumerate(calls):
            missing = sorted(fact for fact in steps.STEPS[call.name].needs & set(RUN_INPUTS) if fact not in given)
            if missing:
                raise PlaybookError(f"{book.path}: {section}[{index}]: step {call.name} needs {missing[0]}, "
                                    "which this run does not give",
                                    hint=RUN_INPUTS[missing[0]])


def _step_call(path: Path, section: str, index: int, item: Any) -> StepCall:
    where = f"{path}: {section}[{index}]"
    if isinstance(item, str):
        item = {item: {}}
    if not isinstance(item, dict) or len(item) != 1:
        raise PlaybookError(f"{where}: a step is '- name: {{args}}'", hint="one step name per list item")
    (name, args), = item.items()
    if name not in steps.STEPS:
        raise PlaybookError(f"{where}: unknown step {name!r}", hint=f"known steps: {', '.join(steps.STEPS)}")
    try:
        parsed = steps.STEPS[name].args.model_validate(args or {})
    except ValidationError as exc:
        raise PlaybookError(f"{where}: step {name}: argument {first_problem(exc).removeprefix('field ')}",
                            hint=f"arguments of {name}: {', '.join(steps.STEPS[name].args.model_fields) or 'none'}") from None
    return StepCall(name=name, args=parsed)


def play(playbook: Playbook, run: HostRun, cancel: threading.Event | None = None) -> PlaybookReport:
    """Play the steps on one host; on failure play `on_failure` (unless `no_rollback`); always unlock.

    `cancel` (Ctrl-C) is checked between steps, never inside one: once set, the next step fails as
    "interrupted (Ctrl-C)", so `on_failure` restores a host whose snapshot was taken. A dry run ends
    before the first step that would change the host, if its `plan` step has not ended it already.
    """
    done: list[StepOutcome] = []
    try:
        for call in playbook.steps:
            if run.options.dry_run and steps.STEPS[call.name].changes_host:
                run.finished = "dry_run"
                break
            if cancel is not None and cancel.is_set():
                outcome = StepOutcome(step=call.name, status="failed", message=INTERRUPTED, code="interrupted")
            else:
                outcome = _play_step(call, run)
            done.append(outcome)
            if outcome.status == "failed":
                return _failed(playbook, run, done, outcome)
            if run.finished:
                break
        return _report(playbook, run, done, outcome=run.finished or "ok")
    finally:
        steps.release_lock(run)


def _play_step(call: StepCall, run: HostRun) -> StepOutcome:
    started = time.monotonic()
    run.progress(call.name)
    try:
        outcome = steps.STEPS[call.name].fn(run, call.args)
    except DeployError as exc:
        outcome = StepOutcome(step=call.name, status="failed", message=str(exc), code=exc.code,
                              hint=exc.hint, bad_input=exc.bad_input, details=exc.details)
    outcome.duration_s = round(time.monotonic() - started, 3)
    return outcome


def _failed(playbook: Playbook, run: HostRun, done: list[StepOutcome], failure: StepOutcome) -> PlaybookReport:
    recovery: list[StepOutcome] = []
    if not run.options.no_rollback and run.changed:
        for call in playbook.on_failure:
            outcome = _play_step(call, run)
            recovery.append(outcome)
            if outcome.status == "failed":
                break
    recovered = bool(recovery) and all(o.status != "failed" for o in recovery)
    if not run.changed:
        result = "interrupted" if failure.code == "interrupted" else "refused"
    else:
        result = "rolled_back" if recovered else "failed"
    report = _report(playbook, run, done, outcome=result)
    report.failed_step, report.reason, report.recovery = failure.step, failure.message, recovery
    return report


def _report(playbook: Playbook, run: HostRun, done: list[StepOutcome], outcome: str) -> PlaybookReport:
    return PlaybookReport(playbook=playbook.name, host=run.host.name, outcome=outcome, steps=done,
                          healthy=run.healthy, summary=run.summary())
