"""The step vocabulary: what one host can be asked to do, each step a function of (HostRun, args).

Steps read facts first and act only on the difference (pyinfra's habit): `plan` finds that an
overlay is already applied and ends the run as a no-op; `restart` without a service says so.
Steps never fan out and never render; they return `StepOutcome`s that keep their evidence.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ddtree_deploy import abi, service
from ddtree_deploy import snapshot as snapshot_ops
from ddtree_deploy.catalog import load_overlay, overlays_path
from ddtree_deploy.errors import HelperError, OverlayError, PreflightError, ProbeError, ServiceError
from ddtree_deploy.inventory import HostSpec
from ddtree_deploy.overlay import Overlay
from ddtree_deploy.plan import Plan
from ddtree_deploy.probes import LosslessProbe, ProbeResult, ProbeSpec, Reference, record_reference, run_probes
from ddtree_deploy.service import ServiceReport
from ddtree_deploy.snapshot import ApplyResult, DeployedState, PruneResult, RestoreResult, SnapshotTaken
from ddtree_deploy.transport import Transport


class StepOutcome(BaseModel):
    step: str
    status: Literal["ok", "noop", "failed", "skipped"]
    message: str = ""
    code: str | None = None
    hint: str = ""
    bad_input: bool = False
    duration_s: float = 0.0
    details: dict[str, Any] = Field(default_factory=dict)


class HostStatus(BaseModel):
    """One row of `status`."""

    host: str
    python: str
    package_root: str
    sglang: str | None
    torch: str | None
    cuda_variant: str | None
    overlay: str | None = None
    snapshot: str | None = None
    launch_args: list[str] = Field(default_factory=list)
    lock: str | None = None
    journal_open: bool = False
    server: str = "no service"
    notes: list[str] = Field(default_factory=list)
    needs_attention: bool = False
    ssh_resolver: str | None = Field(default=None, description="what read the host's ssh_config: openssh or paramiko")


def host_status(transport: Transport) -> HostStatus:
    """Facts for one `status` row: fingerprint, deployed state, lock, journal, server health."""
    fp = abi.Fingerprint.from_helper(transport.call("fingerprint"))
    state = transport.call("state")
    deployed = state.get("deployed") or {}
    lock = state.get("lock")
    notes = []
    if state.get("journal"):
        notes.append("open journal: an operation was interrupted; run `ddtree-deploy rollback`")
    if lock:
        notes.append("lock expired" if lock.get("expired") else f"locked since {lock.get('started')}")
    overlay = f"{deployed['overlay']}@{deployed['version']}" if deployed.get("overlay") else None
    drifted = _overlay_drift_note(transport, overlay) if overlay and not state.get("journal") else None
    if drifted:
        notes.append(drifted)
    server = _server_health(transport)
    return HostStatus(
        host=transport.host.name, python=fp.python_version, package_root=str(state.get("package_root")),
        sglang=fp.sglang_version, torch=fp.torch_version, cuda_variant=fp.cuda_variant, overlay=overlay,
        snapshot=deployed.get("snapshot"), launch_args=list((state.get("launch") or {}).get("argv") or []),
        lock=lock.get("owner") if lock else None, journal_open=bool(state.get("journal")), notes=notes, server=server,
        needs_attention=bool(state.get("journal")) or bool(lock and not lock.get("expired"))
        or server.startswith("unhealthy") or bool(drifted), ssh_resolver=transport.ssh_resolver,
    )


def _overlay_drift_note(transport: Transport, overlay: str) -> str | None:
    """A note when the deployed overlay's own files are no longer what it wrote (say pip reinstalled sglang)."""
    drift = snapshot_ops.verify(transport, overlay_only=True)
    if drift.clean:
        return None
    first = drift.files[0]
    return (f"{len(drift.files)} of {overlay}'s {drift.checked} files changed since the push "
            f"({first.path} {first.kind}); `ddtree-deploy diff --host {transport.host.name}` lists them")


def _server_health(transport: Transport) -> str:
    """'healthy', 'unhealthy: <why>' or 'no service'; a server that is simply stopped is unhealthy."""
    if transport.host.service is None:
        return "no service"
    s = service.status(transport)
    if s.healthy:
        return f"healthy (pid {s.pid}, port {s.port})"
    why = "not running" if not s.running else (s.health_error or f"/health answered {s.health_status}")
    return f"unhealthy: {why}"


# --------------------------------------------------------------------------- a run on one host


class RunOptions(BaseModel):
    """What the operator asked for; the same for every host of a fleet run."""

    model_config = ConfigDict(extra="forbid")

    overlay: str | None = Field(default=None, description="NAME[@VERSION] to push")
    overlays_dir: str | None = None
    dry_run: bool = False
    force: bool = Field(default=False, description="push over drift / roll back across a changed fingerprint")
    no_rollback: bool = False
    to_snapshot: str | None = None
    keep_snapshots: int | None = Field(default=None, ge=1, description="prune: overrides the step's `keep`")
    lock_ttl_s: float = 3600.0


@dataclass
class HostRun:
    """Everything one playbook run learns and does on one host; steps read and fill it in order."""

    transport: Transport
    options: RunOptions
    overlay: Overlay | None = None
    on_progress: Callable[[str, str], None] | None = None
    fingerprint: abi.Fingerprint | None = None
    deployed: DeployedState | None = None
    host_state: dict[str, Any] | None = None  # the `state` op's answer, as preflight read it
    plan: Plan | None = None
    reference: Reference | None = None
    snapshot: SnapshotTaken | None = None
    applied: ApplyResult | None = None
    restored: RestoreResult | None = None
    pruned: PruneResult | None = None
    server: ServiceReport | None = None
    server_args: list[str] = field(default_factory=list)
    probes: list[ProbeResult] = field(default_factory=list)
    overlay_live: bool = False  # the overlay's files are on the host (its probes apply)
    locked: bool = False
    changed: bool = False  # a snapshot was taken: from here on, a failure rolls back
    finished: str | None = None  # "noop" or "dry_run": the playbook ends early, successfully
    healthy: bool | None = None

    @property
    def host(self) -> HostSpec:
        return self.transport.host

    def progress(self, step: str) -> None:
        if self.on_progress is not None:
            self.on_progress(self.host.name, step)

    def summary(self) -> dict[str, Any]:
        """The evidence a report keeps beside the step outcomes."""
        out: dict[str, Any] = {}
        if self.plan is not None:
            out["plan"] = {"overlay": f"{self.plan.overlay}@{self.plan.version}", "base": self.plan.base,
                           "digest": self.plan.digest, "changes": [c.model_dump() for c in self.plan.changes]}
            if self.options.dry_run:
                out["diff"] = self.plan.unified_diff()
        if self.snapshot is not None:
            out["snapshot"] = self.snapshot.id
        if self.restored is not None:
            out["restored"] = self.restored.model_dump()
        if self.pruned is not None:
            out["pruned"] = self.pruned.model_dump()
        if self.server is not None:
            out["server"] = self.server.model_dump(exclude={"stop"})
        if self.probes:
            out["probes"] = [p.model_dump() for p in self.probes]
        return out


class StepDef(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    fn: Callable[[HostRun, Any], StepOutcome]
    args: type[BaseModel]


class NoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _ok(step: str, message: str, **details: Any) -> StepOutcome:
    return StepOutcome(step=step, status="ok", message=message, details=details)


def _noop(step: str, message: str, **details: Any) -> StepOutcome:
    return StepOutcome(step=step, status="noop", message=message, details=details)


# --------------------------------------------------------------------------- preflight


class PreflightArgs(NoArgs):
    lock: bool = True
    allow_open_journal: bool = False
    check_drift: bool = True
    check_overlay: bool = True
    refuse_broken_stack: bool = True  # false for rollback, stop, prune: never blocked by it, the problems are reported


def preflight(run: HostRun, args: PreflightArgs) -> StepOutcome:
    """Lock, fingerprint, then refuse on an open journal, an inconsistent stack, an incompatible overlay or drift."""
    t = run.transport
    if args.lock and not run.options.dry_run:
        take_lock(t, run.options.lock_ttl_s)
        run.locked = True
    run.fingerprint = abi.Fingerprint.from_helper(t.call("fingerprint"), host=run.host.name)
    state = run.host_state = t.call("state")
    run.deployed = DeployedState.model_validate(state["deployed"]) if state.get("deployed") else None
    run.server_args = list((state.get("launch") or {}).get("server_args") or [])
    journal = state.get("journal")
    if journal and not args.allow_open_journal:
        raise PreflightError(
            f"an interrupted operation left an open journal (snapshot {journal.get('snapshot')})",
            host=run.host.name, code="journal_open",
            hint=f"run `ddtree-deploy rollback --host {run.host.name}` to restore that snapshot")
    problems = abi.check_host_stack(run.host.name, run.fingerprint)
    not_blocking = ""
    if not args.refuse_broken_stack:
        not_blocking = "".join(f"; {p.field}: {p.message} (reported, not blocking)" for p in abi.errors_of(problems))
        problems = []
    if args.check_overlay and run.overlay is not None:
        problems += _overlay_problems(run)
    abi.raise_problems(problems)
    if args.check_drift and run.deployed is not None and not journal:
        _refuse_drift(run)
    return _ok("preflight", f"{run.fingerprint.sglang_version} on torch {run.fingerprint.torch_version}"
               + (f", {run.deployed.label} deployed" if run.deployed and run.deployed.label else "") + not_blocking)


def take_lock(t: Transport, ttl_s: float) -> None:
    """Lock the host; a lock whose controller ran on this machine and is dead is taken over (and logged)."""
    me = {"host": socket.gethostname(), "pid": os.getpid()}
    try:
        t.call("lock", {"owner": t.owner, "ttl_s": ttl_s, "controller": me})
    except HelperError as exc:
        holder = exc.details.get("holder") or {}
        if exc.code != "locked" or not _dead_local_controller(holder.get("controller")):
            raise
        t.call("lock", {"owner": t.owner, "ttl_s": ttl_s, "controller": me, "take_over": holder.get("owner")})


def _dead_local_controller(controller: Any) -> bool:
    if not isinstance(controller, dict) or controller.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(controller["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, TypeError, ValueError):
        return False
    return False


def _overlay_problems(run: HostRun) -> list[abi.AbiProblem]:
    assert run.overlay is not None and run.fingerprint is not None
    manifest = run.overlay.manifest
    problems = abi.check_requires(run.host.name, run.fingerprint, manifest.requires)
    if manifest.artifacts:
        problems += abi.select_artifacts(run.host.name, run.fingerprint, manifest.artifacts).problems
    run.overlay.require_base(run.fingerprint.sglang_version or "none", host=run.host.name)
    return problems


def _refuse_drift(run: HostRun) -> None:
    drift = snapshot_ops.verify(run.transport)
    if drift.clean or run.options.force:
        return
    files = ", ".join(f"{d.path} ({d.kind})" for d in drift.files[:5])
    more = f" and {len(drift.files) - 5} more" if len(drift.files) > 5 else ""
    raise PreflightError(f"installed files drifted from what was deployed: {files}{more}", host=run.host.name,
                         code="drift", details={"drift": drift.model_dump()},
                         hint=f"see `ddtree-deploy diff --host {run.host.name}`; push --force overwrites, "
                              "rollback restores the snapshot")


# --------------------------------------------------------------------------- plan, reference, snapshot, apply


def plan_step(run: HostRun, args: NoArgs) -> StepOutcome:
    """Compute the writes locally from the host's file facts; end the run if nothing would change."""
    assert run.overlay is not None and run.fingerprint is not None, "plan needs an overlay and a preflight"
    artifacts = None
    if run.overlay.manifest.artifacts:
        artifacts = abi.select_artifacts(run.host.name, run.fingerprint, run.overlay.manifest.artifacts).folder
    run.plan = snapshot_ops.plan_for_host(run.transport, run.overlay, run.fingerprint.sglang_version or "",
                                          artifacts_folder=artifacts, deployed=run.deployed)
    run.server_args = list(run.overlay.manifest.server.args)
    counts = _change_counts(run.plan)
    if run.plan.noop:
        run.finished = "noop"
        return _noop("plan", f"{run.overlay.label} already applied; nothing to change")
    if run.options.dry_run:
        run.finished = "dry_run"
    return _ok("plan", f"{run.overlay.label} on sglang {run.plan.base}: {counts}")


def _change_counts(plan: Plan) -> str:
    kinds = [c.action for c in plan.changes]
    return ", ".join(f"{kinds.count(k)} {k}" for k in ("write", "create", "delete") if k in kinds) or "no changes"


def reference(run: HostRun, args: NoArgs) -> StepOutcome:
    """Record the live server's greedy answers that the lossless probes will compare against."""
    specs = _probe_specs(run, with_overlay=True)
    if not any(isinstance(s, LosslessProbe) for s in specs):
        return _noop("reference", "no lossless probe declared")
    if run.host.service is None or not service.status(run.transport).healthy:
        return _noop("reference", "server not healthy before the push: lossless probes have no reference")
    run.reference = record_reference(run.transport, specs)
    return _ok("reference", f"recorded {len(run.reference.outputs)} greedy answers")


class SnapshotArgs(NoArgs):
    reason: str = "pre-push"


def snapshot(run: HostRun, args: SnapshotArgs) -> StepOutcome:
    """Record the installed package in the host's store; from here on a failure rolls back."""
    fp = run.fingerprint.model_dump(mode="json") if run.fingerprint else None
    run.snapshot = snapshot_ops.take_snapshot(run.transport, args.reason, fp)
    run.changed = True
    s = run.snapshot
    return _ok("snapshot", f"{s.id}: {s.files} files, {s.new_objects} new objects ({s.new_bytes} bytes) "
               f"in {s.seconds:.2f}s")


def apply(run: HostRun, args: NoArgs) -> StepOutcome:
    """Apply the plan as one journaled transaction on top of the snapshot just taken."""
    assert run.plan is not None and run.snapshot is not None, "apply needs plan and snapshot first"
    run.applied = snapshot_ops.apply_plan(run.transport, run.plan, run.snapshot.id)
    run.overlay_live = True
    return _ok("apply", f"{run.plan.overlay}@{run.plan.version}: {_change_counts(run.plan)}")


# --------------------------------------------------------------------------- restore, restart, probe


class RestoreArgs(NoArgs):
    snapshot: str | None = Field(default=None, description="default: this run's snapshot, the journal's, or the deployed one's")


def restore(run: HostRun, args: RestoreArgs) -> StepOutcome:
    """Put the package back exactly as a snapshot recorded it, verified by re-hashing."""
    target = args.snapshot or run.options.to_snapshot or (run.snapshot.id if run.snapshot else None)
    if target is None and run.deployed is None and not _host_state(run).get("journal"):
        return _noop("restore", "nothing deployed and no interrupted operation: nothing to restore")
    if run.fingerprint is not None and not run.options.force:
        abi.raise_problems(_snapshot_problems(run, target), code="fingerprint_changed")
    run.changed = True
    run.restored = snapshot_ops.restore(run.transport, target)
    run.overlay_live = False
    restored = snapshot_ops.deployed_state(run.transport)
    r = run.restored
    message = (f"restored {r.snapshot}: {len(r.restored)} files back, {len(r.removed)} removed, "
               f"{r.verified} verified" + (", open journal closed" if r.closed_journal else ""))
    try:
        run.server_args = _server_args_of(restored, run)
    except OverlayError as exc:  # the files are back; only the server's extra args are unknown
        run.server_args = []
        label = restored.label if restored else "its overlay"
        message += f"; cannot load {label} ({exc}): the server starts with the inventory's args only"
    return _ok("restore", message)


def _host_state(run: HostRun) -> dict[str, Any]:
    """The `state` answer preflight read (one round trip at most, also in playbooks without preflight)."""
    if run.host_state is None:
        run.host_state = run.transport.call("state")
    return run.host_state


def _snapshot_problems(run: HostRun, target: str | None) -> list[abi.AbiProblem]:
    """Compare the host's fingerprint now with the one recorded in the target snapshot."""
    assert run.fingerprint is not None
    listing = run.transport.call("snapshots")
    journal = _host_state(run).get("journal") or {}
    target = target or journal.get("snapshot") or (listing.get("state") or {}).get("snapshot")
    recorded = next((s.get("fingerprint") for s in listing.get("snapshots", []) if s["id"] == target), None)
    if not recorded:
        return []  # unknown ids are refused by the restore itself, naming the known ones
    then = abi.Fingerprint.from_helper(recorded, host=run.host.name)
    return abi.check_snapshot_compat(run.host.name, run.fingerprint, then)


def _server_args_of(state: DeployedState | None, run: HostRun) -> list[str]:
    """After a restore, the server runs with the args of whatever overlay the snapshot holds (usually none)."""
    if state is None or not state.label:
        return []
    if run.overlay is not None and run.overlay.label == state.label:
        return list(run.overlay.manifest.server.args)
    return list(load_overlay(state.label, overlays_path(run.options.overlays_dir)).manifest.server.args)


class IfChangedArgs(NoArgs):
    if_changed: bool = Field(default=False, description="do nothing unless this run changed the package")


def restart(run: HostRun, args: IfChangedArgs) -> StepOutcome:
    """Stop the server, start it with the base and overlay args, wait for readiness failing fast."""
    if args.if_changed and not run.changed:
        return _noop("restart", "package unchanged: server left as it is")
    if run.host.service is None:
        return _noop("restart", "no service configured: nothing restarted")
    run.server = service.restart(run.transport, run.server_args)
    run.transport.call("record_launch", {"argv": run.server.argv, "server_args": run.server_args})
    if not run.server.ready:
        run.healthy = False
    run.server.raise_for_failure()
    return _ok("restart", f"ready after {run.server.waited_s:.1f}s (pid {run.server.pid})")


def stop(run: HostRun, args: NoArgs) -> StepOutcome:
    """Stop the server's whole process group (or unit) and confirm its port is free."""
    if run.host.service is None:
        return _noop("stop", "no service configured: nothing to stop")
    stopped = service.stop(run.transport)
    run.healthy = None
    if not stopped.was_running:
        return _noop("stop", "server was not running")
    if not stopped.port_free:
        raise ServiceError(f"port {stopped.port} still in use after stopping", host=run.host.name,
                           code="port_taken", details=stopped.model_dump(),
                           hint="another process holds the port; see `ddtree-deploy status`")
    how = "SIGKILL after the grace period" if stopped.sigkill else "SIGTERM"
    return _ok("stop", f"stopped {len(stopped.pids)} processes ({how}) in {stopped.waited_s:.1f}s; port free")


def probe(run: HostRun, args: IfChangedArgs) -> StepOutcome:
    """Run the overlay's probes (while its files are live; after rolling back to this run's snapshot, its
    lossless ones) and the inventory's; any failure fails the step."""
    if args.if_changed and not run.changed:
        return _noop("probe", "package unchanged: nothing to probe")
    if run.host.service is None:
        return _noop("probe", "no service configured: nothing to probe")
    specs = _probe_specs(run, with_overlay=run.overlay_live)
    run.probes = run_probes(run.transport, specs, run.reference)
    failed = [p for p in run.probes if not p.ok]
    run.healthy = not failed
    if failed:
        raise ProbeError("; ".join(f"{p.name}: {p.message}" for p in failed), host=run.host.name,
                         code="probe_failed", details={"probes": [p.model_dump() for p in run.probes]},
                         hint=f"see `ddtree-deploy logs --host {run.host.name}`")
    skipped = sum(1 for p in run.probes if p.status == "skipped")
    return _ok("probe", f"{len(run.probes) - skipped} probes passed" + (f", {skipped} skipped" if skipped else ""))


def _probe_specs(run: HostRun, *, with_overlay: bool) -> list[ProbeSpec]:
    own = list(run.overlay.manifest.probes) if run.overlay is not None else []
    if not with_overlay:
        # After a rollback to the snapshot this run took, the server must answer as it did before the
        # change: the overlay's lossless probes still apply, against the answers recorded then.
        own = [p for p in own if isinstance(p, LosslessProbe)] if _restored_own_snapshot(run) else []
    return own + list(run.host.probes)


def _restored_own_snapshot(run: HostRun) -> bool:
    return (run.reference is not None and run.snapshot is not None and run.restored is not None
            and run.restored.snapshot == run.snapshot.id)


class PruneArgs(NoArgs):
    keep: int = Field(default=5, ge=1, description="newest snapshots to keep (besides those rollback needs)")


def prune(run: HostRun, args: PruneArgs) -> StepOutcome:
    """Free the host's store: drop old snapshots and the contents only they used (never a rollback target)."""
    keep = run.options.keep_snapshots or args.keep
    run.pruned = p = snapshot_ops.prune_store(run.transport, keep, dry_run=run.options.dry_run)
    what = f"{len(p.removed)} snapshots and {p.objects_removed} objects ({p.bytes_freed / 1e6:.1f} MB)"
    if run.options.dry_run:
        run.finished = "dry_run"
        return _ok("prune", f"dry run: would remove {what}; {len(p.kept)} kept")
    if not p.removed and not p.objects_removed:
        return _noop("prune", f"nothing to remove: {len(p.kept)} snapshots kept")
    return _ok("prune", f"removed {what}; {len(p.kept)} kept")


def release_lock(run: HostRun) -> None:
    """Always the last thing a run does on a host it locked."""
    if run.locked:
        run.transport.call("unlock", {"owner": run.transport.owner})
        run.locked = False


STEPS: dict[str, StepDef] = {
    "preflight": StepDef(fn=preflight, args=PreflightArgs),
    "plan": StepDef(fn=plan_step, args=NoArgs),
    "reference": StepDef(fn=reference, args=NoArgs),
    "snapshot": StepDef(fn=snapshot, args=SnapshotArgs),
    "apply": StepDef(fn=apply, args=NoArgs),
    "restore": StepDef(fn=restore, args=RestoreArgs),
    "restart": StepDef(fn=restart, args=IfChangedArgs),
    "probe": StepDef(fn=probe, args=IfChangedArgs),
    "stop": StepDef(fn=stop, args=NoArgs),
    "prune": StepDef(fn=prune, args=PruneArgs),
}
