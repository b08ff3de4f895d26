"""Client of hostside/transactions.py: a plan applied, or a snapshot restored, as one journaled transaction."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from ddtree_deploy.errors import HelperError, UsageError
from ddtree_deploy.protocol import DamagedRecord, Journal

if TYPE_CHECKING:
    from ddtree_deploy.transport import Transport


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
    closed_journal: bool = Field(description="an interrupted operation's journal (or a damaged one) was closed")


class _Restored(BaseModel):
    snapshot: str
    restored: list[str]
    removed: list[str]
    modes: list[str]
    verified: int
    closed_journal: Journal | None
    damaged_journal: DamagedRecord | None = None


def apply(t: Transport, request: dict[str, Any]) -> ApplyResult:
    """Apply a plan's `apply` request (`overlay.Plan.helper_args`) on top of the snapshot it names.

    Raises:
        HelperError: code preimage_changed (the host changed since the plan), snapshot_stale,
            journal_open, locked / not_locked (the caller lacks the host lock), disk_full / read_only (nothing
            was changed).
    """
    return t.run_helper("apply", request).parsed(ApplyResult, host=t.host.name)


def restore(t: Transport, snapshot_id: str | None = None) -> RestoreResult:
    """Restore the package exactly as `snapshot_id` recorded it (default: the open journal's, else the deployed one's).

    Raises:
        UsageError: code unknown_snapshot or no_snapshot (lists the host's latest ids).
        HelperError: code restore_unverified (journal left open), disk_full (nothing changed), locked or
            not_locked (the caller does not hold the host lock; nothing changed).
    """
    try:
        done = t.run_helper("restore", {"snapshot": snapshot_id}).parsed(_Restored)
    except HelperError as exc:
        if exc.code in ("unknown_snapshot", "no_snapshot"):
            raise UsageError(str(exc), host=exc.host, code=exc.code, hint=exc.hint, result=exc.result) from None
        raise
    closed = done.closed_journal is not None or done.damaged_journal is not None
    return RestoreResult(host=t.host.name, closed_journal=closed,
                         **done.model_dump(exclude={"closed_journal", "damaged_journal"}))
