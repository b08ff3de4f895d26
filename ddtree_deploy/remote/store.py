"""Client of hostside/store.py: snapshots into the host's content-addressed store, listing, file facts, prune."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from ddtree_deploy.protocol import DeployedState

if TYPE_CHECKING:
    from ddtree_deploy.transport import Transport

#: one path's facts as `read_files` answers them, for `overlay.HostFile.from_helper` (overlay owns the model)
FileAnswer = dict[str, Any]


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


class HostSnapshots(BaseModel):
    """One host's snapshots (oldest first) and what is deployed on it."""

    host: str
    deployed: str | None = Field(default=None, description="name@version of the deployed overlay")
    rollback_target: str | None = Field(default=None, description="the snapshot `rollback` restores by default")
    snapshots: list[SnapshotSummary] = Field(default_factory=list)


class _Listing(BaseModel):
    snapshots: list[SnapshotSummary] = Field(default_factory=list)
    state: DeployedState | None = None


class PruneResult(BaseModel):
    """What `prune` removed from (or, in a dry run, would remove from) a host's store."""

    kept: list[str] = Field(description="snapshot ids left, oldest first")
    removed: list[str] = Field(description="snapshot ids removed")
    objects_removed: int = Field(description="stored contents no kept snapshot uses")
    bytes_freed: int
    dry_run: bool


class _Files(BaseModel):
    files: dict[str, FileAnswer]


def snapshot(t: Transport, reason: str, fingerprint: dict[str, Any] | None = None) -> SnapshotTaken:
    """Record the host's package into its store (only new contents are copied).

    Raises:
        HelperError: code journal_open, locked / not_locked (the caller lacks the host lock), disk_full (the
            store is left as it was).
    """
    return t.run_helper("snapshot", {"reason": reason, "fingerprint": fingerprint}).parsed(SnapshotTaken)


def snapshots(t: Transport) -> HostSnapshots:
    """The host's snapshots, oldest first, with the deployed overlay and the default rollback target."""
    listing = t.run_helper("snapshots").parsed(_Listing)
    state = listing.state
    return HostSnapshots(host=t.host.name, deployed=state.label if state else None,
                         rollback_target=state.snapshot if state else None, snapshots=listing.snapshots)


def read_files(t: Transport, paths: list[str], *, snapshot: str | None = None,
               with_content: bool = True) -> dict[str, FileAnswer]:
    """Hash, mode, size (and bytes) of `paths` on the host; with `snapshot`, also as that snapshot recorded them.

    Raises:
        HelperError: code path_escapes (a path or a symlink on the host leads outside the package).
    """
    args = {"paths": paths, "want_content": paths if with_content else [], "snapshot": snapshot}
    return t.run_helper("read_files", args).parsed(_Files).files


def prune(t: Transport, keep: int, *, dry_run: bool) -> PruneResult:
    """Keep the newest `keep` snapshots and those rollback and plans need; drop the rest and unused objects."""
    return t.run_helper("prune", {"keep": keep, "dry_run": dry_run}).parsed(PruneResult)
