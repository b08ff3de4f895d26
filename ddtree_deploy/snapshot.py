"""Snapshots, journaled apply, restore and drift, seen from the controller: one helper call each, typed results.

Each function takes a `Transport` to one host and returns a pydantic model (or raises the
`DeployError` the helper's refusal maps to). The host side is `hostside/store.py`; the plan itself
is computed by `plan.plan()`, and `plan_for_host()` fetches the facts it needs in one call.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from ddtree_deploy.errors import HelperError, UsageError
from ddtree_deploy.overlay import Overlay
from ddtree_deploy.plan import HostFile, Plan, facts_needed, plan
from ddtree_deploy.transport import Transport


class SnapshotSummary(BaseModel):
    """One row of `snapshots`."""

    id: str
    time: float
    reason: str = ""
    files: int
    overlay: str | None = Field(default=None, description="name@version deployed when it was taken")
    digest: str = Field(default="", description="sha256 over the file list; equal digests mean equal packages")
    fingerprint: dict[str, Any] | None = Field(default=None, exclude=True, description="host facts when taken")


class SnapshotTaken(SnapshotSummary):
    new_objects: int = Field(description="contents the store did not have yet")
    new_bytes: int
    bytes: int = Field(description="size of the whole package")
    same_as: str | None = Field(default=None, description="an earlier snapshot with exactly these files")
    seconds: float


class DeployedState(BaseModel):
    """state.json: what the host says is deployed."""

    overlay: str | None = None
    version: str | None = None
    digest: str | None = None
    base: str | None = Field(default=None, description="the sglang release the overlay was applied to")
    snapshot: str | None = Field(default=None, description="rollback target: the snapshot taken before the push")
    base_snapshot: str | None = Field(default=None, description="the package without any overlay")
    files: dict[str, Any] = Field(default_factory=dict, description="the overlay's post-images by path")

    @property
    def label(self) -> str | None:
        return f"{self.overlay}@{self.version}" if self.overlay else None


class ApplyResult(BaseModel):
    host: str
    changed: int
    created: list[str] = Field(default_factory=list)
    deleted: list[str] = Field(default_factory=list)
    snapshot: str


class RestoreResult(BaseModel):
    host: str
    snapshot: str
    restored: list[str] = Field(default_factory=list, description="files brought back from the store")
    removed: list[str] = Field(default_factory=list, description="files the snapshot did not have")
    modes: list[str] = Field(default_factory=list, description="paths whose mode was put back")
    verified: int = Field(description="files re-checked against the snapshot after restoring")
    closed_journal: bool = Field(description="an interrupted operation's journal was closed")


class DriftEntry(BaseModel):
    path: str
    kind: str = Field(description="modified | missing | added | mode")
    expected: dict[str, Any] | None = None
    actual: dict[str, Any] | None = None


class DriftReport(BaseModel):
    """Installed files versus what the host's state says should be there."""

    host: str
    baseline: str | None = Field(description="base snapshot compared against; None when nothing was ever deployed")
    overlay: str | None = None
    clean: bool
    checked: int
    files: list[DriftEntry] = Field(default_factory=list)
    journal_open: bool = False

    def summary(self) -> str:
        if self.clean:
            return f"{self.host}: no drift ({self.checked} files checked)"
        listed = ", ".join(f"{d.path} ({d.kind})" for d in self.files[:5])
        more = f" and {len(self.files) - 5} more" if len(self.files) > 5 else ""
        return f"{self.host}: {len(self.files)} files drifted: {listed}{more}"


def take_snapshot(t: Transport, reason: str, fingerprint: dict[str, Any] | None = None) -> SnapshotTaken:
    """Record the host's package into its store (only new contents are copied).

    Raises:
        HelperError: code journal_open, locked, disk_full (the store is left as it was).
    """
    return SnapshotTaken.model_validate(t.call("snapshot", {"reason": reason, "fingerprint": fingerprint}))


class HostSnapshots(BaseModel):
    """One host's snapshots (oldest first) and what is deployed on it."""

    host: str
    deployed: str | None = Field(default=None, description="name@version of the deployed overlay")
    rollback_target: str | None = Field(default=None, description="the snapshot `rollback` restores by default")
    snapshots: list[SnapshotSummary] = Field(default_factory=list)


def list_snapshots(t: Transport) -> HostSnapshots:
    """The host's snapshots, oldest first, with the deployed overlay and the default rollback target."""
    data = t.call("snapshots")
    state = DeployedState.model_validate(data["state"]) if data.get("state") else None
    return HostSnapshots(host=t.host.name, deployed=state.label if state else None,
                         rollback_target=state.snapshot if state else None,
                         snapshots=[SnapshotSummary.model_validate(s) for s in data.get("snapshots", [])])


class PruneResult(BaseModel):
    """What `prune` removed from (or, in a dry run, would remove from) a host's store."""

    kept: list[str] = Field(description="snapshot ids left, oldest first")
    removed: list[str] = Field(description="snapshot ids removed")
    objects_removed: int = Field(description="stored contents no kept snapshot uses")
    bytes_freed: int
    dry_run: bool


def prune_store(t: Transport, keep: int, *, dry_run: bool) -> PruneResult:
    """Keep the newest `keep` snapshots and those rollback and plans need; drop the rest and unused objects."""
    return PruneResult.model_validate(t.call("prune", {"keep": keep, "dry_run": dry_run}))


def deployed_state(t: Transport) -> DeployedState | None:
    """state.json as the host has it (None before the first push)."""
    deployed = t.call("state").get("deployed")
    return DeployedState.model_validate(deployed) if deployed else None


def read_host_files(t: Transport, paths: list[str], *, snapshot: str | None = None,
                    with_content: bool = True) -> dict[str, HostFile]:
    """Hash, mode, size (and bytes) of `paths` on the host; with `snapshot`, also as that snapshot recorded them.

    Raises:
        HelperError: code path_escapes (a path or a symlink on the host leads outside the package).
    """
    args = {"paths": paths, "want_content": paths if with_content else [], "snapshot": snapshot}
    files = t.call("read_files", args)["files"]
    return {p: HostFile.from_helper(f) for p, f in files.items()}


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
    facts = read_host_files(t, facts_needed(overlay, base_version, owned, artifacts_folder), snapshot=base_snapshot)
    return plan(overlay, base_version, facts, artifacts_folder=artifacts_folder, deployed_paths=owned,
                base_snapshot=base_snapshot, host=t.host.name)


def apply_plan(t: Transport, the_plan: Plan, snapshot_id: str) -> ApplyResult:
    """Apply the plan as one journaled transaction on top of snapshot `snapshot_id` (the rollback target).

    Raises:
        HelperError: code preimage_changed (the host changed since the plan), snapshot_stale,
            journal_open, disk_full / read_only (nothing was changed).
    """
    data = t.call("apply", the_plan.helper_args(snapshot_id))
    return ApplyResult(host=t.host.name, **data)


def restore(t: Transport, snapshot_id: str | None = None) -> RestoreResult:
    """Restore the package exactly as `snapshot_id` recorded it (default: the open journal's, else the deployed one's).

    Raises:
        UsageError: code unknown_snapshot (lists the host's latest ids).
        HelperError: code restore_unverified (journal left open), disk_full (nothing changed).
    """
    try:
        data = t.call("restore", {"snapshot": snapshot_id})
    except HelperError as exc:
        if exc.code in ("unknown_snapshot", "no_snapshot"):
            raise UsageError(str(exc), host=exc.host, code=exc.code, hint=exc.hint, result=exc.result) from None
        raise
    return RestoreResult(host=t.host.name, snapshot=data["snapshot"], restored=data["restored"],
                         removed=data["removed"], modes=data["modes"], verified=data["verified"],
                         closed_journal=data["closed_journal"] is not None)


def verify(t: Transport, *, deep: bool = False, overlay_only: bool = False) -> DriftReport:
    """Compare installed files with the deployed state, file by file (`deep` re-hashes every file;
    `overlay_only` checks just the deployed overlay's own files, without walking the package)."""
    data = t.call("verify", {"deep": deep, "overlay_only": overlay_only})
    return DriftReport(host=t.host.name, baseline=data["baseline"], overlay=data["overlay"], clean=data["clean"],
                       checked=data["checked"], files=[DriftEntry.model_validate(d) for d in data["files"]],
                       journal_open=data["journal"] is not None)
