"""Client of hostside/drift.py: installed files compared with what the host's state says is deployed."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, field_validator

from ddtree_deploy.protocol import Journal

if TYPE_CHECKING:
    from ddtree_deploy.transport import Transport


class DriftEntry(BaseModel):
    path: str
    kind: str = Field(description="modified | missing | added | mode")
    expected: dict[str, Any] | None = None
    actual: dict[str, Any] | None = None
    expected_content: bytes | None = Field(default=None, exclude=True, repr=False,
                                           description="with content: the bytes the store has for `expected`")
    actual_content: bytes | None = Field(default=None, exclude=True, repr=False,
                                         description="with content: the installed bytes")
    content_note: str = Field(default="", description="with content: a side that is not shown, and why")
    diff: str | None = Field(default=None, description="with content: unified diff, expected -> installed")

    @field_validator("expected_content", "actual_content", mode="before")
    @classmethod
    def _decoded(cls, value: Any) -> Any:
        """The helper sends file bytes as base64."""
        return base64.b64decode(value) if isinstance(value, str) else value


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


def verify(t: Transport, *, deep: bool = False, overlay_only: bool = False, content: bool = False) -> DriftReport:
    """Compare installed files with the deployed state, file by file (`deep` re-hashes every file;
    `overlay_only` checks just the deployed overlay's own files, without walking the package;
    `content` also fetches each drifted file's expected and installed bytes)."""
    args = {"deep": deep, "overlay_only": overlay_only, "content": content}
    found = t.run_helper("verify", args).parsed(_Verified)
    return DriftReport(host=t.host.name, journal_open=found.journal is not None, baseline=found.baseline,
                       overlay=found.overlay, clean=found.clean, checked=found.checked, files=found.files)
