"""The step vocabulary: what one host can be asked to do, each step a function of (HostRun, args).

Steps read facts first and act only on the difference (pyinfra's habit): `plan` finds that an
overlay is already applied and ends the run as a no-op (unless no probe ever verified it: then the
run goes on to restart and probe it); `restart` without a service says so.
Each step declares the facts it `needs` and those it `gives` (`StepDef`), so `playbook.py`
refuses an order that cannot work before any host is touched. A run (`hostrun.py`) keeps what
preflight read (`Facts`, never changed afterwards) apart from what the steps produced (`Results`).
Steps never fan out and never render; they return `StepOutcome`s that keep their evidence.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, Field

from ddtree_deploy import abi, service
from ddtree_deploy.benchmark.sweep import BenchArgs
from ddtree_deploy.catalog import load_overlay, overlays_path
from ddtree_deploy.errors import (
    BenchError,
    HelperError,
    OverlayError,
    PlaybookError,
    PreflightError,
    ProbeError,
    ServiceError,
    UsageError,
)
from ddtree_deploy.hostrun import Fact, Facts, HostRun, NoArgs, StepDef, StepOutcome
from ddtree_deploy.overlay import Overlay
from ddtree_deploy.plan import HostFile, Plan, facts_needed, plan
from ddtree_deploy.probes import LosslessProbe, ProbeSpec
from ddtree_deploy.probing import record_reference, run_probes
from ddtree_deploy.protocol import DamagedRecord, DeployedState, HostState, LockController
from ddtree_deploy.remote import deployed, drift, facts, locks, store, transactions
from ddtree_deploy.remote.service import ServiceStatus
from ddtree_deploy.remote.store import HostSnapshots
from ddtree_deploy.transport import Transport
from ddtree_deploy.wording import plural

T = TypeVar("T")


def _needed(value: T | None, step: str, fact: Fact) -> T:
    """A fact `step` declared in its `needs`; missing only in a run no playbook checked (a bug, said plainly)."""
    if value is None:
        raise PlaybookError(f"step {step} needs {fact}, which no earlier step of this run gave", code="step_order",
                            hint="play it from a playbook, which puts a step that gives it first")
    return value


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
    allow_damaged_state: bool = False  # rollback (--to restores anyway) and stop: a damaged state file is no obstacle


def preflight(run: HostRun, args: PreflightArgs) -> StepOutcome:
    """Lock, fingerprint, then refuse on an open journal, an inconsistent stack, an incompatible overlay or drift."""
    t = run.transport
    if args.lock and not run.options.dry_run:
        take_lock(t, run.options.lock_ttl_s)
        run.locked = True
    fp = abi.Fingerprint.from_helper(facts.fingerprint(t), host=run.host.name)
    run.facts = Facts(fingerprint=fp, state=locks.state(t))
    state, deployed = run.facts.state, run.facts.deployed
    run.server_args = list(state.launch.server_args) if state.launch else []
    if state.journal and not args.allow_open_journal:
        raise PreflightError(
            f"an interrupted operation left an open journal (snapshot {state.journal.snapshot})",
            host=run.host.name, code="journal_open",
            hint=f"run `ddtree-deploy rollback --host {run.host.name}` to restore that snapshot")
    if state.damaged and not args.allow_damaged_state:
        raise damaged_error(run, state.damaged)
    problems = abi.check_host_stack(run.host.name, fp)
    not_blocking = ""
    if not args.refuse_broken_stack:
        not_blocking = "".join(f"; {p.field}: {p.message} (reported, not blocking)" for p in abi.errors_of(problems))
        problems = []
    if args.check_overlay and run.overlay is not None:
        problems += _overlay_problems(run.host.name, fp, run.overlay)
    abi.raise_problems(problems)
    if args.check_drift and deployed is not None and not state.journal:
        _refuse_drift(run)
    label = f", {deployed.label} deployed" + (" (never verified)" if deployed.unverified else "") \
        if deployed and deployed.label else ""
    return _ok("preflight", f"{fp.sglang_version} on torch {fp.torch_version}{label}{not_blocking}")


def damaged_error(run: HostRun, damaged: list[DamagedRecord], why: str = "") -> PreflightError:
    """A state file that cannot be read, named, with the snapshots `rollback --to` can restore (the store is intact)."""
    known = [s.id for s in store.snapshots(run.transport).snapshots][-10:]
    first = damaged[0]
    return PreflightError(f"{first.path} is damaged ({first.error}){why}", host=run.host.name, code="state_damaged",
                          details={"damaged": [d.model_dump() for d in damaged], "snapshots": known},
                          hint=f"restore a snapshot, which rewrites it: `ddtree-deploy rollback --host {run.host.name} "
                               f"--to SNAPSHOT`; snapshots (newest last): {', '.join(known) or 'none'}")


def take_lock(t: Transport, ttl_s: float) -> None:
    """Lock the host; a lock whose controller ran on this machine and is dead is taken over (and logged)."""
    me = LockController(host=socket.gethostname(), pid=os.getpid())
    try:
        locks.lock(t, ttl_s=ttl_s, controller=me)
    except HelperError as exc:
        holder = locks.holder_of(exc)
        if holder is None or holder.owner is None or not _dead_local_controller(holder.controller):
            raise
        locks.lock(t, ttl_s=ttl_s, controller=me, take_over=holder.owner)


def _dead_local_controller(controller: LockController | None) -> bool:
    if controller is None or controller.host != socket.gethostname() or controller.pid <= 0:
        return False
    try:
        os.kill(controller.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _overlay_problems(host: str, fp: abi.Fingerprint, overlay: Overlay) -> list[abi.AbiProblem]:
    manifest = overlay.manifest
    problems = abi.check_requires(host, fp, manifest.requires)
    if manifest.artifacts:
        problems += abi.select_artifacts(host, fp, manifest.artifacts).problems
    overlay.require_base(fp.sglang_version or "none", host=host)
    return problems


def _refuse_drift(run: HostRun) -> None:
    found = drift.verify(run.transport)
    if found.clean or run.options.force:
        return
    files = ", ".join(f"{d.path} ({d.kind})" for d in found.files[:5])
    more = f" and {len(found.files) - 5} more" if len(found.files) > 5 else ""
    raise PreflightError(f"installed files drifted from what was deployed: {files}{more}", host=run.host.name,
                         code="drift", details={"drift": found.model_dump()},
                         hint=f"see `ddtree-deploy diff --host {run.host.name}`; push --force overwrites, "
                              "rollback restores the snapshot")


# --------------------------------------------------------------------------- plan, reference, snapshot, apply


def plan_step(run: HostRun, args: NoArgs) -> StepOutcome:
    """Compute the writes locally from the host's file facts; end the run if nothing would change."""
    overlay, known = _needed(run.overlay, "plan", "overlay"), _needed(run.facts, "plan", "fingerprint")
    fp, artifacts = known.fingerprint, None
    if overlay.manifest.artifacts:
        artifacts = abi.select_artifacts(run.host.name, fp, overlay.manifest.artifacts).folder
    planned = run.results.plan = plan_for_host(run.transport, overlay, fp.sglang_version or "",
                                               artifacts_folder=artifacts, deployed=known.deployed)
    run.server_args = list(overlay.manifest.server.args)
    deployed = known.deployed
    # Equal digests mean this very version is what the host records (the digest covers the label, so a
    # version that changes only server.args or probes over equal files is a deployment of its own).
    recorded = deployed is not None and deployed.digest == planned.digest
    unverified = deployed is not None and deployed.unverified and deployed.label == overlay.label
    if planned.noop and recorded and not unverified:
        run.finished = "noop"
        return _noop("plan", f"{overlay.label} already applied; nothing to change")
    if run.options.dry_run:
        run.finished = "dry_run"
    if planned.noop and unverified:  # applied by a push that never finished its probes: restart and probe it
        run.reverify = run.overlay_live = True
        return _ok("plan", f"{overlay.label} already applied but never verified: restart and probe it")
    if planned.noop:
        return _ok("plan", f"{overlay.label} lands the files already there; recording it, then restart and probe")
    return _ok("plan", f"{overlay.label} on sglang {planned.base}: {_change_counts(planned)}")


def plan_for_host(t: Transport, overlay: Overlay, base_version: str, *, artifacts_folder: str | None = None,
                  deployed: DeployedState | None = None) -> Plan:
    """Fetch the facts `plan.plan` needs from the host (one call) and compute the plan.

    With an overlay deployed, its base snapshot supplies the pristine bytes to patch, and the
    paths it owns but `overlay` does not are reverted. A deployed record made on another sglang
    release is ignored (the pre-image checks then judge the files as they are).
    """
    if deployed is not None and deployed.base not in (None, base_version):
        deployed = None  # sglang was reinstalled under the overlay: its record no longer describes these files
    base_snapshot = deployed.base_snapshot if deployed and deployed.overlay else None
    owned = sorted(deployed.files) if deployed and deployed.overlay else []
    paths = facts_needed(overlay, base_version, owned, artifacts_folder)
    files = {p: HostFile.from_helper(f) for p, f in store.read_files(t, paths, snapshot=base_snapshot).items()}
    return plan(overlay, base_version, files, artifacts_folder=artifacts_folder, deployed_paths=owned,
                base_snapshot=base_snapshot, host=t.host.name)


def _change_counts(plan: Plan) -> str:
    kinds = [c.action for c in plan.changes]
    return ", ".join(f"{kinds.count(k)} {k}" for k in ("write", "create", "delete") if k in kinds) or "no changes"


def reference(run: HostRun, args: NoArgs) -> StepOutcome:
    """Record the live server's greedy answers that the lossless probes will compare against."""
    specs = _probe_specs(run, with_overlay=True)
    if not any(isinstance(s, LosslessProbe) for s in specs):
        return _noop("reference", "no lossless probe declared")
    live = service.status(run.transport) if run.host.service is not None else None
    if live is None or not live.healthy:
        return _noop("reference", "server not healthy before the push: lossless probes have no reference")
    if run.reverify and not _started_before_apply(live, run.deployed):
        return _noop("reference", "the server was started after the overlay was applied: no answers from before "
                                  "it to compare with, lossless probes have no reference")
    recorded = run.results.reference = record_reference(run.transport, specs)
    return _ok("reference", f"recorded {len(recorded.outputs)} greedy answers")


def _started_before_apply(live: ServiceStatus, state: DeployedState | None) -> bool:
    """The live server still runs the code from before the apply (it was started before it)."""
    return live.started is not None and state is not None and state.applied is not None and live.started < state.applied


class SnapshotArgs(NoArgs):
    reason: str = "pre-push"


def snapshot(run: HostRun, args: SnapshotArgs) -> StepOutcome:
    """Record the installed package in the host's store; from here on a failure rolls back."""
    if run.reverify and run.deployed is not None:
        run.changed = True  # a failure restores the snapshot taken before the overlay was applied
        return _noop("snapshot", f"overlay already applied: a failure restores {run.deployed.snapshot}, taken before it")
    fp = run.facts.fingerprint.model_dump(mode="json") if run.facts else None
    s = run.results.snapshot = store.snapshot(run.transport, args.reason, fp)
    run.changed = True
    return _ok("snapshot", f"{s.id}: {plural(s.files, 'file')}, {plural(s.new_objects, 'new object')} ({s.new_bytes} bytes) "
               f"in {s.seconds:.2f}s")


def apply(run: HostRun, args: NoArgs) -> StepOutcome:
    """Apply the plan as one journaled transaction on top of the snapshot just taken."""
    planned = _needed(run.results.plan, "apply", "plan")
    if run.reverify:
        return _noop("apply", f"{planned.overlay}@{planned.version} already applied")
    taken = _needed(run.results.snapshot, "apply", "snapshot")
    run.results.applied = transactions.apply(run.transport, planned.helper_args(taken.id))
    run.overlay_live = True
    return _ok("apply", f"{planned.overlay}@{planned.version}: {_change_counts(planned)}")


# --------------------------------------------------------------------------- restore, restart, probe


class RestoreArgs(NoArgs):
    snapshot: str | None = Field(default=None, description="default: this run's snapshot, the journal's, or the deployed one's")


def restore(run: HostRun, args: RestoreArgs) -> StepOutcome:
    """Put the package back exactly as a snapshot recorded it, verified by re-hashing."""
    taken, chosen = run.results.snapshot, args.snapshot or run.options.to_snapshot
    target = chosen or (taken.id if taken else None)
    state = _host_state(run)
    if target is None and state.damaged:
        raise damaged_error(run, state.damaged, ": a plain rollback cannot tell which snapshot to restore")
    if target is None and not (state.deployed and state.deployed.overlay) and not state.journal:
        return _noop("restore", "nothing deployed and no interrupted operation: nothing to restore")
    listing = store.snapshots(run.transport)
    known = [s.id for s in listing.snapshots]
    if chosen is not None and chosen not in known:  # bad input: refused before anything is touched
        raise UsageError(f"no snapshot {chosen} on this host", host=run.host.name, code="unknown_snapshot",
                         hint=f"known snapshots (newest last): {', '.join(known[-10:]) or 'none'}")
    if run.facts is not None and not run.options.force:
        abi.raise_problems(_snapshot_problems(run, run.facts, target, listing), code="fingerprint_changed")
    run.changed = True
    r = run.results.restored = transactions.restore(run.transport, target)
    run.overlay_live = False
    restored = locks.state(run.transport).deployed
    message = (f"restored {r.snapshot}: {plural(len(r.restored), 'file')} back, {len(r.removed)} removed, "
               f"{r.verified} verified" + (", open journal closed" if r.closed_journal else ""))
    try:
        run.server_args = _server_args_of(restored, run)
    except OverlayError as exc:  # the files are back; only the server's extra args are unknown
        run.server_args = []
        label = restored.label if restored else "its overlay"
        message += f"; cannot load {label} ({exc}): the server starts with the inventory's args only"
    return _ok("restore", message)


def _host_state(run: HostRun) -> HostState:
    """The `state` answer preflight read; read now in a playbook without preflight."""
    return run.facts.state if run.facts is not None else locks.state(run.transport)


def _snapshot_problems(run: HostRun, known: Facts, target: str | None, listing: HostSnapshots) -> list[abi.AbiProblem]:
    """Compare the host's fingerprint as preflight read it with the one recorded in the target snapshot."""
    journal = known.state.journal
    target = target or (journal.snapshot if journal else None) or listing.rollback_target
    recorded = next((s.fingerprint for s in listing.snapshots if s.id == target), None)
    if not recorded:
        return []  # recorded without a fingerprint: nothing to compare with
    then = abi.Fingerprint.from_helper(recorded, host=run.host.name)
    return abi.check_snapshot_compat(run.host.name, known.fingerprint, then)


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
    server = run.results.server = service.restart(run.transport, run.server_args)
    locks.record_launch(run.transport, server.argv, run.server_args)
    if not server.ready:
        run.healthy = False
    server.raise_for_failure()
    return _ok("restart", f"ready after {server.waited_s:.1f}s (pid {server.pid})")


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
        return _verified(run, _noop("probe", "no service configured: nothing to probe"))
    specs = _probe_specs(run, with_overlay=run.overlay_live)
    probed = run.results.probes = run_probes(run.transport, specs, run.results.reference)
    failed = [p for p in probed if not p.ok]
    run.healthy = not failed
    if failed:
        raise ProbeError("; ".join(f"{p.name}: {p.message}" for p in failed), host=run.host.name,
                         code="probe_failed", details={"probes": [p.model_dump() for p in probed]},
                         hint=f"see `ddtree-deploy logs --host {run.host.name}`")
    skipped = sum(1 for p in probed if p.status == "skipped")
    return _verified(run, _ok("probe", f"{plural(len(probed) - skipped, 'probe')} passed"
                              + (f", {skipped} skipped" if skipped else "")))


def _verified(run: HostRun, outcome: StepOutcome) -> StepOutcome:
    """Once the probes of the overlay this run pushed passed (or no server runs to probe), the host records
    it verified; until then `status` flags it and a push of it restarts and probes instead of doing nothing."""
    planned = run.results.plan
    if run.overlay_live and planned is not None and not run.options.dry_run:
        deployed.mark_verified(run.transport, planned.digest)
        outcome.message += f"; {planned.overlay}@{planned.version} recorded as verified"
    return outcome


def _probe_specs(run: HostRun, *, with_overlay: bool) -> list[ProbeSpec]:
    own = list(run.overlay.manifest.probes) if run.overlay is not None else []
    if not with_overlay:
        # After a rollback to the snapshot this run took, the server must answer as it did before the
        # change: the overlay's lossless probes still apply, against the answers recorded then.
        own = [p for p in own if isinstance(p, LosslessProbe)] if _restored_own_snapshot(run) else []
    return own + list(run.host.probes)


def _restored_own_snapshot(run: HostRun) -> bool:
    made = run.results
    return (made.reference is not None and made.snapshot is not None and made.restored is not None
            and made.restored.snapshot == made.snapshot.id)


class PruneArgs(NoArgs):
    keep: int = Field(default=5, ge=1, description="newest snapshots to keep (besides those rollback needs)")


def prune(run: HostRun, args: PruneArgs) -> StepOutcome:
    """Free the host's store: drop old snapshots and the contents only they used (never a rollback target)."""
    keep = run.options.keep_snapshots or args.keep
    p = run.results.pruned = store.prune(run.transport, keep, dry_run=run.options.dry_run)
    what = f"{plural(len(p.removed), 'snapshot')} and {plural(p.objects_removed, 'object')} ({p.bytes_freed / 1e6:.1f} MB)"
    if run.options.dry_run:
        run.finished = "dry_run"
        return _ok("prune", f"dry run: would remove {what}; {len(p.kept)} kept")
    if not p.removed and not p.objects_removed:
        return _noop("prune", f"nothing to remove: {plural(len(p.kept), 'snapshot')} kept")
    return _ok("prune", f"removed {what}; {len(p.kept)} kept")


def bench(run: HostRun, args: BenchArgs) -> StepOutcome:
    """Sweep plain, DFLASH and DDTREE budgets on the server (benchmark/sweep.py); the results ride in `details`."""
    from ddtree_deploy.benchmark.sweep import Sweep  # only a bench pays for it

    if run.host.service is None or not service.status(run.transport).healthy:
        raise BenchError("the server is not healthy: the bench measures a running server and puts it back",
                         host=run.host.name, code="bench_server_down",
                         hint=f"start it with `ddtree-deploy restart --host {run.host.name}`")
    run.found_server_args = list(run.server_args)
    run.changed = True  # from the first restart on, a failure puts the server back (on_failure)
    results = Sweep(run.transport, args, run.found_server_args, run.progress).run()
    return _ok("bench", f"{len(results.variants)} variants measured", bench=results.model_dump(mode="json",
                                                                                             by_alias=True))


def relaunch(run: HostRun, args: NoArgs) -> StepOutcome:
    """Start the server again with the args it ran with before the bench (nothing to do if it already does)."""
    if run.found_server_args is None or run.host.service is None:
        return _noop("relaunch", "the bench never restarted the server")
    wanted = service.launch_argv(run.host.service, run.found_server_args)
    now = service.status(run.transport)
    if now.healthy and now.argv == wanted:
        return _noop("relaunch", "the server already runs with the args it was found with")
    run.server_args = list(run.found_server_args)
    return restart(run, IfChangedArgs()).model_copy(update={"step": "relaunch"})


def adopt(run: HostRun, args: NoArgs) -> StepOutcome:
    """Make the installed files the baseline drift is measured against (once the operator has seen `diff`):
    a snapshot the deployed overlay now sits on. No package file changes; the server is not touched."""
    found = drift.verify(run.transport)
    if found.baseline is not None and found.clean:
        return _noop("adopt", f"no drift: the installed files already match snapshot {found.baseline}")
    fp = run.facts.fingerprint.model_dump(mode="json") if run.facts else None
    done = run.results.adopted = deployed.adopt(run.transport, fp)
    what = plural(len(found.files), "drifted file") if found.baseline else "the installed files (no baseline before)"
    sits = f"{done.deployed.label} now sits on it" if done.deployed.label else "it is the new base"
    return _ok("adopt", f"adopted {what}: snapshot {done.snapshot.id}; {sits}",
               drifted=[d.model_dump() for d in found.files])


def release_lock(run: HostRun) -> None:
    """Always the last thing a run does on a host it locked."""
    if run.locked:
        locks.unlock(run.transport)
        run.locked = False


def _step(fn: Callable[[HostRun, Any], StepOutcome], args: type[BaseModel], *, needs: tuple[Fact, ...] = (),
          gives: tuple[Fact, ...] = (), changes_host: bool = False) -> StepDef:
    return StepDef(fn=fn, args=args, needs=frozenset(needs), gives=frozenset(gives), changes_host=changes_host)


#: the vocabulary; what a step uses only when present (restore: the fingerprint, probe: the reference) is no need
STEPS: dict[str, StepDef] = {
    "preflight": _step(preflight, PreflightArgs, gives=("fingerprint", "host_state")),
    "plan": _step(plan_step, NoArgs, needs=("overlay", "fingerprint", "host_state"), gives=("plan",)),
    "reference": _step(reference, NoArgs, gives=("reference",)),
    "snapshot": _step(snapshot, SnapshotArgs, gives=("snapshot",), changes_host=True),
    "apply": _step(apply, NoArgs, needs=("plan", "snapshot"), gives=("applied",), changes_host=True),
    "restore": _step(restore, RestoreArgs, gives=("restored",), changes_host=True),
    "restart": _step(restart, IfChangedArgs, gives=("server",), changes_host=True),
    "probe": _step(probe, IfChangedArgs, gives=("probes",)),
    "stop": _step(stop, NoArgs, changes_host=True),
    "prune": _step(prune, PruneArgs, gives=("pruned",)),
    # the bench reads the launch args preflight found; its results ride in its outcome's details
    "bench": _step(bench, BenchArgs, needs=("host_state",), changes_host=True),  # it restarts the server
    "relaunch": _step(relaunch, NoArgs, gives=("server",), changes_host=True),
    "adopt": _step(adopt, NoArgs, gives=("adopted",), changes_host=True),
}
