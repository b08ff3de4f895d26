"""Overlays: the manifest models, loading and validation, the pure plan, and the rebase check.

An overlay version lives in `overlays/<name>/<version>/` (OVERLAY_FORMAT.md): `overlay.yaml`, whole
files under `files/`, compiled artifacts under `files-<cuda>/`, and one unified diff per patched file
per base release under `patches/<base>/<path>.diff`. Patches are applied by GNU `patch` in a
temporary folder (never by a hand-written diff parser). `plan()` is pure: host file facts in, a
`Plan` of writes, creations and deletions out. Nothing here touches a host.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import itertools
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from packaging.version import InvalidVersion, Version
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from ddtree_deploy.abi import ArtifactBuild, Requires
from ddtree_deploy.errors import OverlayError, PreflightError
from ddtree_deploy.probes import ProbeSpec
from ddtree_deploy.record import record_path, updated_record
from ddtree_deploy.yamlfile import first_problem, read_mapping

PACKAGE = "sglang"
OVERLAYS_ENV = "DDTREE_OVERLAYS"
CACHE_ENV = "DDTREE_DEPLOY_CACHE"
MANIFEST = "overlay.yaml"
SEMVER = r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$"
DEFAULT_CREATE_MODE = 0o644
REVERT = "revert of the deployed overlay"
RECORD = "pip's RECORD, listing the overlay's files"


# ---------------------------------------------------------------- manifest models


def _package_path(value: str) -> str:
    """A path relative to the package root that stays inside the `sglang` package."""
    parts = value.split("/")
    if value.startswith("/") or "\\" in value or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"path {value!r} escapes the package root (absolute, '..', '.' or empty part)")
    if parts[0] != PACKAGE or len(parts) < 2:
        raise ValueError(f"path {value!r} is not inside the {PACKAGE}/ package")
    return value


PackagePath = Annotated[str, AfterValidator(_package_path)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
SemVer = Annotated[str, StringConstraints(pattern=SEMVER)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Target(_Strict):
    package: Literal["sglang"] = "sglang"
    bases: list[str] = Field(min_length=1, description="releases with a patch set under patches/<base>/")


class ServerSpec(_Strict):
    args: list[str] = Field(default_factory=list, description="launch arguments appended to the service's args")


class OverlayManifest(_Strict):
    """overlay.yaml; unknown keys are errors."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    version: SemVer
    description: str = ""
    target: Target
    requires: Requires = Field(default_factory=Requires)
    files: list[PackagePath] = Field(default_factory=list, description="whole files under files/")
    patches: dict[str, dict[PackagePath, Sha256]] = Field(
        default_factory=dict, description="base release -> {patched path: sha256 of the pristine file}")
    artifacts: dict[str, ArtifactBuild] = Field(default_factory=dict)
    server: ServerSpec = Field(default_factory=ServerSpec)
    probes: list[ProbeSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> OverlayManifest:
        unknown = sorted(set(self.patches) - set(self.target.bases))
        if unknown:
            raise ValueError(f"patches for {unknown[0]!r}, which is not in target.bases {self.target.bases}")
        for variant, build in self.artifacts.items():
            for path in build.files:
                _package_path(path)
            if not re.match(r"^cu\d{3}$", variant):
                raise ValueError(f"artifacts key {variant!r} is not a CUDA variant like cu128")
        doubled = set(self.files) & {p for per in self.patches.values() for p in per}
        if doubled:
            raise ValueError(f"{min(doubled)} is both a whole file and a patched file")
        return self


class Overlay(BaseModel):
    """A loaded, validated overlay version and the folder it lives in."""

    manifest: OverlayManifest
    root: Path

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"

    def patch_file(self, base: str, path: str) -> Path:
        return self.root / "patches" / base / f"{path}.diff"

    def require_base(self, base: str, host: str | None = None) -> dict[str, str]:
        """The patch set for `base`; a release without one is refused, listing the supported ones."""
        if base not in self.manifest.target.bases:
            raise OverlayError(
                f"{self.label} has no patch set for sglang {base}; supported: {', '.join(self.manifest.target.bases)}",
                host=host, code="unsupported_base",
                hint=f"install a supported sglang, or rebase the overlay (`ddtree-deploy overlay check "
                     f"{self.name} --base {base}`)")
        return dict(self.manifest.patches.get(base, {}))

    def touched(self, base: str, artifacts_folder: str | None = None) -> list[str]:
        """Every package path this overlay writes on a host with sglang `base`."""
        return sorted(set(self.manifest.files) | set(self.require_base(base)) | set(self._artifacts(artifacts_folder)))

    def _artifacts(self, folder: str | None) -> list[str]:
        if folder is None:
            return []
        build = self.manifest.artifacts.get(folder.removeprefix("files-"))
        if build is None:
            raise OverlayError(f"{self.label} has no artifacts {folder}/", code="unknown_artifacts",
                               hint=f"available: {', '.join(self.manifest.artifacts) or 'none'}")
        return list(build.files)

    def source_of(self, path: str, artifacts_folder: str | None) -> Path:
        """The overlay file that becomes `path` on the host (files/ or files-<cuda>/)."""
        if artifacts_folder and path in self._artifacts(artifacts_folder):
            return self.root / artifacts_folder / path
        return self.root / "files" / path


# ---------------------------------------------------------------- loading


def overlays_path(explicit: str | None = None) -> Path:
    """`--overlays DIR`, else $DDTREE_OVERLAYS, else ./overlays (relative to the current directory)."""
    return Path(explicit or os.environ.get(OVERLAYS_ENV) or "overlays")


def parse_spec(spec: str) -> tuple[str, str | None]:
    name, _, version = spec.partition("@")
    return name, (version or None)


def load_overlay(spec: str, overlays_dir: Path | None = None) -> Overlay:
    """Load `name@version`, or the latest version of `name` by semver.

    Raises:
        OverlayError: unknown name or version (listing the known ones), malformed YAML, an unknown
            key or bad field (naming file and field), a path escaping the package root, a listed
            file or patch that is missing, a file on disk the manifest does not list.
    """
    folder = overlays_path(None) if overlays_dir is None else overlays_dir
    name, version = parse_spec(spec)
    if not (folder / name).is_dir() or not name:
        known = ", ".join(sorted(p.name for p in folder.glob("*") if p.is_dir())) if folder.is_dir() else ""
        raise OverlayError(f"no overlay {name!r} in {folder}", code="unknown_overlay",
                           hint=f"known overlays: {known}" if known else f"pass --overlays DIR or set {OVERLAYS_ENV}")
    versions = _versions(folder / name)
    if version is None:
        if not versions:
            raise OverlayError(f"{folder / name}: no versions (no */{MANIFEST})", code="unknown_overlay",
                               hint="add overlays/<name>/<version>/overlay.yaml")
        version = versions[-1]
    elif version not in versions:
        raise OverlayError(f"no version {version} of overlay {name} in {folder}", code="unknown_overlay",
                           hint=f"known versions: {', '.join(versions) or 'none'}")
    return read_overlay(folder / name / version)


def _versions(folder: Path) -> list[str]:
    """Version folders holding a manifest, oldest first by semver (names that are not versions last)."""
    names = [p.name for p in folder.iterdir() if (p / MANIFEST).is_file()]
    return sorted(names, key=_semver_key)


def _semver_key(text: str) -> tuple[int, Version | str]:
    try:
        return (0, Version(text))
    except InvalidVersion:
        return (1, text)


def read_overlay(root: Path) -> Overlay:
    """Validate one overlay folder: the manifest, then every file it names and every file it holds."""
    path = root / MANIFEST
    raw = _read_manifest(path)
    try:
        manifest = OverlayManifest.model_validate(raw)
    except ValidationError as exc:
        raise OverlayError(f"{path}: {first_problem(exc)}", hint="fix that field; unknown keys are errors") from None
    if (manifest.name, manifest.version) != (root.parent.name, root.name):
        raise OverlayError(f"{path}: name/version {manifest.name}@{manifest.version} does not match its folder "
                           f"{root.parent.name}/{root.name}", hint="move the folder or fix the manifest")
    overlay = Overlay(manifest=manifest, root=root)
    _check_layout(overlay)
    return overlay


def _read_manifest(path: Path) -> dict[str, Any]:
    return read_mapping(path, OverlayError, what="overlay manifest", read_hint="check the overlay folder")


def _check_layout(overlay: Overlay) -> None:
    """Listed files exist, nothing unlisted hides in the folder, no symlinks, diff headers name their file."""
    m, root = overlay.manifest, overlay.root
    expected = {f"files/{p}" for p in m.files}
    expected |= {f"patches/{base}/{p}.diff" for base, per in m.patches.items() for p in per}
    expected |= {f"files-{v}/{p}" for v, build in m.artifacts.items() for p in build.files}
    present = set()
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            raise OverlayError(f"{path}: symlinks are not allowed in an overlay", hint="replace it by the file itself")
        if path.is_file() and rel != MANIFEST and "__pycache__" not in rel.split("/"):
            present.add(rel)
    for rel in sorted(expected - present):
        raise OverlayError(f"{root / MANIFEST}: lists {rel}, which does not exist", hint="add the file or unlist it")
    for rel in sorted(present - expected):
        raise OverlayError(f"{root / rel}: not listed in {MANIFEST}", hint="list it under files/patches or remove it")
    for base, per in m.patches.items():
        for p in per:
            _check_diff_headers(overlay.patch_file(base, p), p)


def _check_diff_headers(diff: Path, path: str) -> None:
    """A diff patches exactly its own file: `--- a/<path>` then `+++ b/<path>`, once."""
    lines = diff.read_text(errors="replace").splitlines()
    headers = [(old, new) for old, new in itertools.pairwise(lines) if old.startswith("--- ") and new.startswith("+++ ")]
    names = {(o[4:].split("\t")[0].strip(), n[4:].split("\t")[0].strip()) for o, n in headers}
    if names != {(f"a/{path}", f"b/{path}")}:
        raise OverlayError(f"{diff}: headers must be '--- a/{path}' and '+++ b/{path}' (one file per diff), "
                           f"found {sorted(names) or 'none'}", hint="regenerate the diff from a pristine copy")


class OverlayListing(BaseModel):
    """One row of `overlay list`."""

    name: str
    version: str
    description: str = ""
    bases: list[str] = Field(default_factory=list)
    files: int = 0
    patches: int = 0
    artifacts: list[str] = Field(default_factory=list)
    error: str | None = None


class OverlayList(BaseModel):
    """What `overlay list` shows: the folder and its versions."""

    folder: str
    overlays: list[OverlayListing]


def list_overlays(overlays_dir: Path | None = None) -> list[OverlayListing]:
    """Every overlay version under the folder, by name then semver; an invalid one carries its error."""
    folder = overlays_path(None) if overlays_dir is None else overlays_dir
    if not folder.is_dir():
        raise OverlayError(f"no overlays folder {folder}", code="unknown_overlay",
                           hint=f"run from the repository root, pass --overlays DIR or set {OVERLAYS_ENV}")
    rows = []
    for name_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
        for version in _versions(name_dir):
            try:
                m = read_overlay(name_dir / version).manifest
            except OverlayError as exc:
                rows.append(OverlayListing(name=name_dir.name, version=version, error=str(exc)))
                continue
            rows.append(OverlayListing(
                name=m.name, version=m.version, description=m.description.strip(), bases=m.target.bases,
                files=len(m.files), patches=sum(len(per) for per in m.patches.values()),
                artifacts=sorted(m.artifacts)))
    return rows


# ---------------------------------------------------------------- patching


class Conflict(BaseModel):
    """A patch that does not apply: the file, the hunk (if patch named one) and patch's words."""

    file: str
    hunk: int | None = None
    line: int | None = None
    message: str

    def text(self) -> str:
        where = f" hunk #{self.hunk}" + (f" at line {self.line}" if self.line else "") if self.hunk else ""
        return f"{self.file}{where}: {self.message}"


def apply_patch(diff: Path, path: str, pristine: bytes) -> tuple[bytes | None, list[Conflict]]:
    """Run GNU patch (no fuzz) on `pristine` in a temp folder; return the patched bytes, or the conflicts."""
    patch = shutil.which("patch")
    if patch is None:
        raise OverlayError("GNU patch is not installed on this machine", code="patch_missing",
                           hint="install it (apt-get install patch)")
    with tempfile.TemporaryDirectory(prefix="ddtree-patch-") as tmp:
        target = Path(tmp, path)
        target.parent.mkdir(parents=True)
        target.write_bytes(pristine)
        proc = subprocess.run(
            [patch, "-p1", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch", "--reject-file=-",
             "--quoting-style=literal", "-d", tmp, "-i", str(diff.resolve())],
            capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            return target.read_bytes(), []
    return None, _conflicts(path, proc.stdout + proc.stderr)


def _conflicts(path: str, output: str) -> list[Conflict]:
    found = [Conflict(file=path, hunk=int(m.group(1)), line=int(m.group(2)), message="hunk does not apply")
             for m in re.finditer(r"Hunk #(\d+) FAILED at (\d+)", output)]
    if not found:
        last = [line for line in output.strip().splitlines() if line.strip()][-1:] or ["patch failed"]
        found = [Conflict(file=path, message=last[0])]
    return found


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
    old, new = change.old_content or b"", change.content or b""
    a = f"a/{change.path}" if change.action != "create" else "/dev/null"
    b = f"b/{change.path}" if change.action != "delete" else "/dev/null"
    try:
        old_lines, new_lines = old.decode().splitlines(True), new.decode().splitlines(True)
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
            source = overlay.source_of(path, artifacts_folder)
            wanted[path] = (source.read_bytes(), _create_mode(source), source.relative_to(overlay.root).parts[0] + "/")
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


# ---------------------------------------------------------------- rebase check


class BaseCheck(BaseModel):
    """One release: were the patches applied to it and the result byte-compiled?"""

    base: str = Field(description="the pristine release the patches were applied to")
    patches_from: str = Field(description="the patch set used (differs from base when rebasing)")
    ok: bool
    patched: list[str] = Field(default_factory=list)
    compiled: int = 0
    conflicts: list[Conflict] = Field(default_factory=list)
    compile_errors: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


class OverlayCheck(BaseModel):
    overlay: str
    version: str
    ok: bool
    bases: list[BaseCheck]


class OverlayCheckReport(BaseModel):
    """What `overlay check` shows: every version checked, and whether all passed."""

    ok: bool
    checks: list[OverlayCheck]


def cache_dir() -> Path:
    """$DDTREE_DEPLOY_CACHE, else $XDG_CACHE_HOME/ddtree-deploy, else ~/.cache/ddtree-deploy."""
    explicit = os.environ.get(CACHE_ENV)
    return Path(explicit) if explicit else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddtree-deploy"


def pristine_release(version: str, cache: Path | None = None) -> Path:
    """The unpacked sglang `version` (a package root holding sglang/), downloaded once with pip into the cache.

    Raises:
        OverlayError: pip could not download it (the message carries pip's last line).
    """
    releases = (cache or cache_dir()) / "releases"
    unpacked = releases / f"{PACKAGE}-{version}"
    if (unpacked / PACKAGE).is_dir():
        return unpacked
    releases.mkdir(parents=True, exist_ok=True)
    wheel = _find_wheel(releases, version) or _download(releases, version)
    staging = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=releases))
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(staging)
        staging.rename(unpacked)  # atomic: a concurrent run sees the whole tree or none
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (unpacked / PACKAGE).is_dir():
            raise
    return unpacked


def _find_wheel(releases: Path, version: str) -> Path | None:
    found = sorted(releases.glob(f"{PACKAGE}-{version}-*.whl"))
    return found[0] if found else None


def _download(releases: Path, version: str) -> Path:
    with tempfile.TemporaryDirectory(dir=releases) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                               "--disable-pip-version-check", "-d", tmp, f"{PACKAGE}=={version}"],
                              capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob(f"{PACKAGE}-*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise OverlayError(f"cannot download {PACKAGE}=={version}: {last}", code="release_unavailable",
                               hint="check the package index (pip config), or put the wheel in "
                                    f"{releases}/")
        return wheels[0].rename(releases / wheels[0].name)


def check_overlay(overlay: Overlay, bases: list[str] | None = None, cache: Path | None = None) -> OverlayCheck:
    """Apply each patch set to its pristine release, report every conflict by file and hunk, byte-compile the result.

    A base the overlay does not support yet is a rebase check: the newest supported patch set is
    applied to it, and differing pre-images are notes rather than conflicts.
    """
    results = [_check_base(overlay, base, pristine_release(base, cache)) for base in
               (bases or overlay.manifest.target.bases)]
    return OverlayCheck(overlay=overlay.name, version=overlay.version, ok=all(r.ok for r in results), bases=results)


def _check_base(overlay: Overlay, base: str, release: Path) -> BaseCheck:
    supported = overlay.manifest.target.bases
    patches_from = base if base in supported else max(supported, key=_semver_key)
    pre_images = overlay.require_base(patches_from)
    conflicts: list[Conflict] = []
    notes: list[str] = []
    result: dict[str, bytes] = {p: overlay.source_of(p, None).read_bytes() for p in overlay.manifest.files}
    for path, pre_image in sorted(pre_images.items()):
        source = release / path
        if not source.is_file():
            conflicts.append(Conflict(file=path, message=f"not in sglang {base}"))
            continue
        pristine = source.read_bytes()
        if _sha(pristine) != pre_image:
            message = f"pre-image sha256 {pre_image[:12]}... recorded, sglang {base} has {_sha(pristine)[:12]}..."
            if patches_from == base:
                conflicts.append(Conflict(file=path, message=message))
            else:
                notes.append(f"{path}: {message} (expected when rebasing; record the new hash)")
        patched, found = apply_patch(overlay.patch_file(patches_from, path), path, pristine)
        conflicts += found
        if patched is not None:
            result[path] = patched
    errors = _compile_all(result)
    return BaseCheck(base=base, patches_from=patches_from, ok=not conflicts and not errors, patched=sorted(pre_images),
                     conflicts=conflicts, compiled=sum(p.endswith(".py") for p in result) - len(errors),
                     compile_errors=errors, notes=notes)


def _compile_all(files: dict[str, bytes]) -> list[str]:
    """py_compile every .py of the result; one line per file that does not compile."""
    errors = []
    with tempfile.TemporaryDirectory(prefix="ddtree-compile-") as tmp:
        for path, data in sorted(files.items()):
            if not path.endswith(".py"):
                continue
            source = Path(tmp, path)
            source.parent.mkdir(parents=True, exist_ok=True)
            source.write_bytes(data)
            try:
                py_compile.compile(str(source), cfile=str(source) + "c", dfile=path, doraise=True)
            except py_compile.PyCompileError as exc:
                errors.append(f"{path}: {exc.exc_type_name}: {exc.exc_value}")
    return errors
