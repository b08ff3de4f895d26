"""The plan: what applying an overlay changes on one host, computed from the host's file facts (pure).

`plan()` takes the facts of every path an overlay touches (`facts_needed`) and returns a `Plan` of
writes, creations and deletions, pip's RECORD among them. Patches are applied by GNU `patch` in a
temporary folder (`patching`, never a hand-written diff parser). Nothing here touches a host.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from ddtree_deploy.errors import OverlayError, PreflightError
from ddtree_deploy.overlay import Overlay
from ddtree_deploy.patching import apply_patch
from ddtree_deploy.record import record_path, updated_record

DEFAULT_CREATE_MODE = 0o644
REVERT = "revert of the deployed overlay"
RECORD = "pip's RECORD, listing the overlay's files"


# ---------------------------------------------------------------- the plan


class FileFacts(BaseModel):
    """One file as the host helper describes it (now, or as a snapshot recorded it)."""

    exists: bool
    sha256: str | None = None
    mode: int | None = None
    size: int | None = None
    symlink: str | None = None
    content: bytes | None = Field(default=None, exclude=True, repr=False)

    @classmethod
    def from_helper(cls, data: dict[str, Any]) -> FileFacts:
        content = data.get("content")
        return cls(exists=bool(data.get("exists")), sha256=data.get("sha256"), mode=data.get("mode"),
                   size=data.get("size"), symlink=data.get("symlink") or data.get("link"),
                   content=base64.b64decode(content) if content is not None else None)


class HostFile(FileFacts):
    """A file now, and (`base`) as the snapshot the deployed overlay sits on recorded it."""

    base: FileFacts | None = None

    @classmethod
    def from_helper(cls, data: dict[str, Any]) -> HostFile:
        base = data.get("base")
        facts = cls.model_validate(FileFacts.from_helper(data), from_attributes=True)
        facts.content = FileFacts.from_helper(data).content
        return facts.model_copy(update={"base": FileFacts.from_helper(base) if base is not None else None})

    @property
    def pristine(self) -> FileFacts:
        """What the overlay patches: the base snapshot's bytes when an overlay is deployed, else today's."""
        return self.base if self.base is not None else self


class FileChange(BaseModel):
    path: str
    action: Literal["write", "create", "delete"]
    before: str | None = Field(description="sha256 on the host now (re-checked by the helper), None if absent")
    after: str | None = Field(description="sha256 once applied, None for a deletion")
    mode: int | None = None
    why: str = Field(description="files/, files-<cuda>/, patch, or revert of the deployed overlay")
    content: bytes | None = Field(default=None, exclude=True, repr=False)
    old_content: bytes | None = Field(default=None, exclude=True, repr=False)


class PostImage(BaseModel):
    sha256: str
    mode: int


class Plan(BaseModel):
    """What applying an overlay to one host changes, file by file; empty `changes` means already applied."""

    overlay: str
    version: str
    base: str = Field(description="the host's sglang release")
    digest: str = Field(description="sha256 of the overlay's post-images; equal digests mean equal results")
    base_snapshot: str | None = Field(default=None, description="snapshot of the deployed overlay's base, if any")
    changes: list[FileChange] = Field(default_factory=list)
    files: dict[str, PostImage] = Field(default_factory=dict, description="post-image of every overlay path")
    unchanged: list[str] = Field(default_factory=list)

    @property
    def noop(self) -> bool:
        return not self.changes

    def unified_diff(self) -> str:
        """The plan as one unified diff (what `push --dry-run` prints)."""
        return "".join(_diff_one(c) for c in self.changes)

    def helper_args(self, snapshot: str) -> dict[str, Any]:
        """The `apply` request: changes with base64 contents, and the state to record on the host."""
        changes = [{"path": c.path, "action": c.action, "expect": c.before, "sha256": c.after, "mode": c.mode,
                    "content": base64.b64encode(c.content).decode() if c.content is not None else None}
                   for c in self.changes]
        state = {"overlay": self.overlay, "version": self.version, "digest": self.digest, "base": self.base,
                 "snapshot": snapshot, "base_snapshot": self.base_snapshot or snapshot,
                 "files": {p: post.model_dump() for p, post in self.files.items()}}
        return {"changes": changes, "state": state}


def _diff_one(change: FileChange) -> str:
    return file_diff(change.path, change.old_content or b"" if change.action != "create" else None,
                     change.content or b"" if change.action != "delete" else None)


def file_diff(path: str, old: bytes | None, new: bytes | None) -> str:
    """One file's unified diff, `a/path` -> `b/path` (None: the file is absent on that side)."""
    a = f"a/{path}" if old is not None else "/dev/null"
    b = f"b/{path}" if new is not None else "/dev/null"
    try:
        old_lines, new_lines = (old or b"").decode().splitlines(True), (new or b"").decode().splitlines(True)
    except UnicodeDecodeError:
        return f"Binary files {a} and {b} differ\n"
    lines = list(difflib.unified_diff(old_lines, new_lines, a, b))
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def facts_needed(overlay: Overlay, base_version: str, deployed_paths: Iterable[str] = (),
                 artifacts_folder: str | None = None) -> list[str]:
    """Every path `plan` needs the host's facts (and contents) of: the overlay's, the deployed one's, pip's RECORD."""
    return sorted({*overlay.touched(base_version, artifacts_folder), *deployed_paths, record_path(base_version)})


def plan(overlay: Overlay, base_version: str, host_files: dict[str, HostFile], *,
         artifacts_folder: str | None = None, deployed_paths: Iterable[str] = (), base_snapshot: str | None = None,
         host: str | None = None) -> Plan:
    """Compute what applying `overlay` changes on a host running sglang `base_version`.

    Args:
        overlay: the loaded overlay.
        base_version: the host's installed sglang release; it must have a patch set.
        host_files: facts for every path in `overlay.touched(...)` and in `deployed_paths`, with
            contents (`facts_needed` lists them with pip's RECORD; `read_host_files` fetches them).
            When an overlay is deployed, each carries `base`: the file as the deployed overlay's base
            snapshot recorded it. When they also describe an existing pip RECORD, the plan rewrites
            it to list the overlay's files, and the overlay owns it.
        artifacts_folder: the `files-<cuda>/` folder chosen for the host (abi.select_artifacts).
        deployed_paths: paths the deployed overlay owns (state.json `files`); those this overlay
            does not touch go back to their base bytes.
        base_snapshot: the deployed overlay's base snapshot (kept as this overlay's base).
        host: host name for messages.
    Returns:
        The Plan; `plan.noop` when the host already has every post-image.
    Raises:
        OverlayError: unsupported base (lists the supported ones), a patch that does not apply
            (file and hunk). PreflightError: a pre-image hash differs, a target is a symlink.
    """
    pre_images = overlay.require_base(base_version, host)
    wanted: dict[str, tuple[bytes | None, int | None, str]] = {}
    for path in overlay.touched(base_version, artifacts_folder):
        facts = _facts(host_files, path, host)
        if path in pre_images:
            wanted[path] = (_patched(overlay, base_version, path, pre_images[path], facts, host), None, "patch")
        else:
            wanted[path] = (overlay.content_of(path, artifacts_folder), _create_mode(overlay.source_of(path, artifacts_folder)),
                            overlay.folder_of(path, artifacts_folder) + "/")
    owned = set(wanted)
    for path in sorted(set(deployed_paths) - owned):
        base = _facts(host_files, path, host).pristine
        wanted[path] = (_content_of(base, path), base.mode, REVERT)
    record = record_path(base_version)
    if record in host_files and host_files[record].pristine.exists:  # kept in step when the host has one
        listed = {path: content for path in owned if (content := wanted[path][0]) is not None}
        pip_record = _content_of(_facts(host_files, record, host).pristine, record) or b""
        wanted[record] = (updated_record(pip_record, listed), None, RECORD)
        owned.add(record)
    changes, files, unchanged = [], {}, []
    for path, (content, mode, why) in sorted(wanted.items()):
        now = host_files[path]
        change = _change(path, now, content, mode, why)
        if path in owned and content is not None:
            kept = change.mode if change else now.mode
            files[path] = PostImage(sha256=_sha(content), mode=kept or DEFAULT_CREATE_MODE)
        if change is None:
            unchanged.append(path)
        else:
            changes.append(change)
    digest = _sha(json.dumps({"overlay": overlay.label, "base": base_version,
                              "files": {p: f.sha256 for p, f in files.items()}}, sort_keys=True).encode())
    return Plan(overlay=overlay.name, version=overlay.version, base=base_version, digest=digest,
                base_snapshot=base_snapshot, changes=changes, files=files, unchanged=unchanged)


def _content_of(facts: FileFacts, path: str) -> bytes | None:
    if facts.exists and facts.content is None:
        raise ValueError(f"plan() needs the content of {path}")  # a caller bug, like a missing fact
    return facts.content if facts.exists else None


def _create_mode(source: Path) -> int:
    return 0o755 if os.access(source, os.X_OK) else DEFAULT_CREATE_MODE


def _facts(host_files: dict[str, HostFile], path: str, host: str | None) -> HostFile:
    facts = host_files.get(path)
    if facts is None:
        raise ValueError(f"plan() needs facts for {path}")  # a caller bug: read_host_files fetches them all
    if facts.symlink is not None:
        raise PreflightError(f"{path} is a symlink on the host (to {facts.symlink}); refusing to write through it",
                             host=host, code="path_is_symlink", hint="replace the symlink by a regular file")
    return facts


def _patched(overlay: Overlay, base: str, path: str, pre_image: str, facts: HostFile, host: str | None) -> bytes:
    pristine = facts.pristine
    if not pristine.exists or pristine.sha256 != pre_image or pristine.content is None:
        found = pristine.sha256 if pristine.exists else "no such file"
        raise PreflightError(
            f"{path}: expected the pristine sglang {base} file (sha256 {pre_image[:12]}...), host has {found}",
            host=host, code="preimage_mismatch",
            hint="the installed file was modified outside ddtree-deploy; reinstall sglang or restore a snapshot")
    patched, conflicts = apply_patch(overlay.patch_file(base, path), path, pristine.content)
    if patched is None:
        raise OverlayError(f"{overlay.label}: patch does not apply: {conflicts[0].text()}", host=host,
                           code="patch_conflict", hint=f"rebase it: ddtree-deploy overlay check {overlay.label}",
                           details={"conflicts": [c.model_dump() for c in conflicts]})
    return patched


def _change(path: str, now: HostFile, content: bytes | None, mode: int | None, why: str) -> FileChange | None:
    if content is None:
        if not now.exists:
            return None
        return FileChange(path=path, action="delete", before=now.sha256, after=None, why=why,
                          old_content=now.content)
    if now.exists and now.sha256 == _sha(content):
        return None
    action: Literal["write", "create"] = "write" if now.exists else "create"
    keep = now.mode if now.exists else None  # a rewritten file keeps its mode, like `patch` does
    return FileChange(path=path, action=action, before=now.sha256 if now.exists else None, after=_sha(content),
                      mode=keep or mode or DEFAULT_CREATE_MODE, why=why, content=content, old_content=now.content)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
