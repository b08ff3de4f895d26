"""Client of hostside/drift.py: installed files compared with what the host's state says is deployed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from ddtree_deploy.protocol import Journal

if TYPE_CHECKING:
    from ddtree_deploy.transport import Transport


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


class _Verified(BaseModel):
    baseline: str | None
    overlay: str | None
    clean: bool
    checked: int
    files: list[DriftEntry]
    journal: Journal | None


def verify(t: Transport, *, deep: bool = False, overlay_only: bool = False) -> DriftReport:
    """Compare installed files with the deployed state, file by file (`deep` re-hashes every file;
    `overlay_only` checks just the deployed overlay's own files, without walking the package)."""
    found = t.run_helper("verify", {"deep": deep, "overlay_only": overlay_only}).parsed(_Verified)
    return DriftReport(host=t.host.name, journal_open=found.journal is not None,
                       **found.model_dump(exclude={"journal"}))
