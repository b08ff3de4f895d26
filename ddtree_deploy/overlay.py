"""Overlay versions: the manifest, reading a version with its parent chain (`inherits`), and exporting it.

A version lives in `<folder>/<name>/<version>/`: `overlay.yaml`, whole files under `files/`, compiled
artifacts under `files-<cuda>/`, and one unified diff per patched file per base release under
`patches/<base>/<path>.diff`. A version that `inherits:` an older one holds only what it changes: new
files whole, its changes to a file it inherits as a diff against the parent's bytes under
`edits/<path>.diff`, and a new file made from an inherited one (`derived:`, a module split out of another)
as a diff from that file's bytes, also under `edits/`; the rest resolves from its parent chain when it loads
(overlays/ddtree/README.md states the rules), so an `Overlay` is always the whole version a push lands.
Nothing here touches a host.
"""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from packaging.version import InvalidVersion, Version
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ddtree_deploy.abi import ArtifactBuild, Requires
from ddtree_deploy.errors import OverlayError
from ddtree_deploy.patching import apply_patch
from ddtree_deploy.probes import ProbeSpec
from ddtree_deploy.yamlfile import first_problem, read_mapping

PACKAGE = "sglang"
MANIFEST = "overlay.yaml"
SEMVER = r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$"
#: Fields a version that leaves them out takes from its parent, whole (the payload fields merge instead).
INHERITED = ("target", "requires", "server", "probes")


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
    """overlay.yaml; unknown keys are errors. Loaded, it describes the whole resolved version."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    version: SemVer
    inherits: SemVer | None = Field(default=None, description="the version of this overlay it is built on")
    description: str = ""
    target: Target
    requires: Requires = Field(default_factory=Requires)
    files: list[PackagePath] = Field(default_factory=list, description="whole files under files/")
    patches: dict[str, dict[PackagePath, Sha256]] = Field(
        default_factory=dict, description="base release -> {patched path: sha256 of the pristine file}")
    artifacts: dict[str, ArtifactBuild] = Field(default_factory=dict)
    edits: list[PackagePath] = Field(
        default_factory=list, description="inherited whole files this version changes, as diffs under edits/")
    derived: dict[PackagePath, PackagePath] = Field(
        default_factory=dict, description="new whole file -> the inherited whole file it is made from, by a diff "
                                          "under edits/<new file>.diff (a module split out of another)")
    drops: list[PackagePath] = Field(default_factory=list, description="inherited paths this version no longer ships")
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
        doubled = set(self.files) & self.patched_paths()
        if doubled:
            raise ValueError(f"{min(doubled)} is both a whole file and a patched file")
        if (self.edits or self.derived) and self.inherits is None:
            raise ValueError("edits and derived need inherits: a version without a parent has no file to edit")
        both = sorted(set(self.edits) & (set(self.files) | self.patched_paths()))
        if both:
            raise ValueError(f"{both[0]} is both edited and shipped whole or patched")
        both = sorted(set(self.derived) & (set(self.files) | self.patched_paths() | set(self.edits)))
        if both:
            raise ValueError(f"{both[0]} is both derived and shipped whole, patched or edited")
        itself = sorted(new for new, source in self.derived.items() if new == source)
        if itself:
            raise ValueError(f"derived {itself[0]} is made from itself: list it under edits")
        return self

    @field_validator("drops")
    @classmethod
    def _drops(cls, drops: list[str], info: ValidationInfo) -> list[str]:
        if drops and info.data.get("inherits") is None:
            raise ValueError("needs inherits: a version without a parent has nothing to drop")
        shipped = set(info.data.get("files", [])) | {p for per in info.data.get("patches", {}).values() for p in per}
        shipped |= set(info.data.get("edits", [])) | set(info.data.get("derived", {}))
        both = sorted(set(drops) & shipped)
        if both:
            raise ValueError(f"{both[0]} is both dropped and shipped")
        return drops

    def patched_paths(self) -> set[str]:
        return {p for per in self.patches.values() for p in per}

    def layout(self) -> set[str]:
        """Every file of the version folder, relative to it (the manifest aside)."""
        held = {f"files/{p}" for p in self.files} | {f"edits/{p}.diff" for p in [*self.edits, *self.derived]}
        held |= {f"patches/{base}/{p}.diff" for base, per in self.patches.items() for p in per}
        return held | {f"files-{v}/{p}" for v, build in self.artifacts.items() for p in build.files}


class Overlay(BaseModel):
    """A loaded, validated overlay version, resolved through its parent chain."""

    manifest: OverlayManifest = Field(description="the whole version: its own fields and everything inherited")
    root: Path = Field(description="the version's own folder")
    sources: dict[str, Path] = Field(
        description="each file of the resolved layout -> the folder file holding it (for an edited file: the "
                    "ancestor's file it was derived from, whose mode it keeps)")
    edited: dict[str, bytes] = Field(default_factory=dict, description="layout files made by edits -> their bytes")
    held: list[str] = Field(default_factory=list, description="the layout files this version's folder holds")

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
        return self.sources[f"patches/{base}/{path}.diff"]

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

    def folder_of(self, path: str, artifacts_folder: str | None) -> str:
        """`files` or the `files-<cuda>` folder whose copy of `path` becomes the host's."""
        return artifacts_folder if artifacts_folder and path in self._artifacts(artifacts_folder) else "files"

    def source_of(self, path: str, artifacts_folder: str | None) -> Path:
        """The overlay file that becomes `path` on the host (files/ or files-<cuda>/, here or in a parent;
        for an edited file, the one it was derived from): its mode is the host file's."""
        return self.sources[f"{self.folder_of(path, artifacts_folder)}/{path}"]

    def content_of(self, path: str, artifacts_folder: str | None) -> bytes:
        """The bytes `path` gets on the host: the file itself, or the result of this chain's edits."""
        return self._layout_bytes(f"{self.folder_of(path, artifacts_folder)}/{path}")

    def _layout_bytes(self, rel: str) -> bytes:
        return self.edited[rel] if rel in self.edited else self.sources[rel].read_bytes()


# ---------------------------------------------------------------- reading a version


def read_overlay(root: Path) -> Overlay:
    """Validate one version folder and resolve it through its parent chain.

    Raises:
        OverlayError: malformed YAML, an unknown key or bad field (naming file and field), a path
            escaping the package root, a listed file that is missing or a file that is not listed,
            a parent that is missing or inherits back (a cycle), a drop of a path the parent does
            not ship, a file or patch that is a byte copy of the parent's, an edit or derived file
            whose diff does not apply, changes nothing or names no whole file the parent ships.
    """
    return _read(root, ())


def _read(root: Path, descendants: tuple[str, ...]) -> Overlay:
    path = root / MANIFEST
    raw = read_mapping(path, OverlayError, what="overlay manifest", read_hint="check the overlay folder")
    parent = _parent(root, raw.get("inherits"), descendants)
    inherited = {} if parent is None else parent.manifest.model_dump(include={f for f in INHERITED if f not in raw})
    try:
        own = OverlayManifest.model_validate({**inherited, **raw})
    except ValidationError as exc:
        raise OverlayError(f"{path}: {first_problem(exc)}", hint="fix that field; unknown keys are errors") from None
    if (own.name, own.version) != (root.parent.name, root.name):
        raise OverlayError(f"{path}: name/version {own.name}@{own.version} does not match its folder "
                           f"{root.parent.name}/{root.name}", hint="move the folder or fix the manifest")
    held = _check_layout(root, own)
    if parent is None:
        return Overlay(manifest=own, root=root, sources={rel: root / rel for rel in held}, held=sorted(held))
    return _inherit(own, root, held, parent)


def _parent(root: Path, inherits: Any, descendants: tuple[str, ...]) -> Overlay | None:
    """The parent version, read first (its own errors name its own file), or None for a root version."""
    if inherits is None:
        return None
    path = root / MANIFEST
    if not isinstance(inherits, str) or not re.match(SEMVER, inherits):
        raise OverlayError(f"{path}: field inherits: not a version of {root.parent.name} (got {inherits!r})",
                           hint="name the version this one is built on, e.g. inherits: 0.2.0")
    chain = (*descendants, root.name)
    if inherits in chain:
        raise OverlayError(f"{path}: field inherits: {' -> '.join((*chain, inherits))} is a cycle",
                           hint="a version inherits from an older one, never from itself or a descendant")
    if not (root.parent / inherits / MANIFEST).is_file():
        raise OverlayError(f"{path}: field inherits: no version {inherits} of {root.parent.name} in {root.parent}",
                           hint=f"known versions: {', '.join(versions_in(root.parent)) or 'none'}")
    return _read(root.parent / inherits, chain)


def _inherit(own: OverlayManifest, root: Path, held: set[str], parent: Overlay) -> Overlay:
    """`own` on top of its parent: its files and patches replace the parent's for the same path."""
    path = root / MANIFEST
    shipped = parent.manifest.patched_paths() | set(parent.manifest.files)
    for dropped in own.drops:
        if dropped not in shipped:
            raise OverlayError(f"{path}: field drops: {parent.label} does not ship {dropped}",
                               hint="drop only files or patched files the parent version ships")
    for rel in sorted(held & set(parent.sources)):
        if (root / rel).read_bytes() == parent._layout_bytes(rel):
            raise OverlayError(
                f"{path}: field {_field_of(rel)}: {rel} is a byte copy of {parent.sources[rel]} ({parent.label})",
                hint=f"delete {root / rel} and unlist it: a version inherits what it does not change")
    edited = {rel: data for rel, data in parent.edited.items() if rel.removeprefix("files/") not in own.drops}
    edited.update(_edits(own, root, parent))
    edited.update(_derived(own, root, parent))
    replaced = set(own.drops) | set(own.files) | own.patched_paths()
    files = sorted({p for p in parent.manifest.files if p not in replaced} | set(own.files) | set(own.edits)
                   | set(own.derived))
    patches = {base: {**{p: sha for p, sha in parent.manifest.patches.get(base, {}).items() if p not in replaced},
                      **own.patches.get(base, {})} for base in own.target.bases}
    manifest = own.model_copy(update={
        "files": files, "patches": {base: per for base, per in patches.items() if per}, "edits": [], "derived": {},
        "artifacts": {**parent.manifest.artifacts, **own.artifacts}})
    # A derived file's mode is its source's.
    origin = {f"files/{new}": f"files/{source}" for new, source in own.derived.items()}
    sources = {rel: root / rel if rel in held else parent.sources[origin.get(rel, rel)]
               for rel in sorted(manifest.layout())}
    edited = {rel: data for rel, data in edited.items() if rel in sources and rel not in held}  # a whole file wins
    return Overlay(manifest=manifest, root=root, sources=sources, edited=edited, held=sorted(held))


def _edits(own: OverlayManifest, root: Path, parent: Overlay) -> dict[str, bytes]:
    """Each of `own`'s edits applied to the parent's bytes of that file (which may be an edit themselves).

    Raises:
        OverlayError: an edit of a file the parent does not ship whole, a diff that does not apply
            (naming the hunk), or one that changes nothing.
    """
    path = root / MANIFEST
    result = {}
    for edit in own.edits:
        rel, diff = f"files/{edit}", root / "edits" / f"{edit}.diff"
        if edit not in parent.manifest.files:
            raise OverlayError(f"{path}: field edits: {parent.label} does not ship {edit} as a whole file",
                               hint="edit only files the parent ships under files/; add a new file under files:")
        after = _patched(diff, edit, parent)
        if after == parent._layout_bytes(rel):
            raise OverlayError(f"{diff}: changes nothing in {parent.label}'s {edit}",
                               hint=f"delete it and unlist {edit} from edits: a version inherits what it does not change")
        result[rel] = after
    return result


def _derived(own: OverlayManifest, root: Path, parent: Overlay) -> dict[str, bytes]:
    """Each of `own`'s derived files: its diff applied to the parent's bytes of the file it is made from.

    Raises:
        OverlayError: a source the parent does not ship whole, a new file the parent already ships, a
            diff that does not apply (naming the hunk), or one that changes nothing (a copy).
    """
    path = root / MANIFEST
    shipped = set(parent.manifest.files) | parent.manifest.patched_paths()
    result = {}
    for new, source in own.derived.items():
        diff = root / "edits" / f"{new}.diff"
        if source not in parent.manifest.files:
            raise OverlayError(f"{path}: field derived: {parent.label} does not ship {source} as a whole file",
                               hint="derive only from files the parent ships under files/")
        if new in shipped:
            raise OverlayError(f"{path}: field derived: {parent.label} already ships {new}",
                               hint=f"list {new} under edits: a derived file is a new one")
        after = _patched(diff, source, parent)
        if after == parent._layout_bytes(f"files/{source}"):
            raise OverlayError(f"{diff}: makes {new} a copy of {parent.label}'s {source}",
                               hint="a derived file must differ from its source: import it instead")
        result[f"files/{new}"] = after
    return result


def _patched(diff: Path, source: str, parent: Overlay) -> bytes:
    """The parent's resolved bytes of the whole file `source` through `diff`.

    Raises:
        OverlayError: the diff does not apply (naming the hunk).
    """
    after, conflicts = apply_patch(diff, source, parent._layout_bytes(f"files/{source}"))
    if after is None:
        raise OverlayError(f"{diff}: does not apply to {parent.label}'s {source}: {conflicts[0].text()}",
                           hint=f"regenerate it: diff -u against `ddtree-deploy overlay export {parent.label}`")
    return after


def _field_of(rel: str) -> str:
    """The manifest field that lists a layout file: files, patches.<base> or artifacts.<cuda>."""
    top, _, rest = rel.partition("/")
    if top == "patches":
        return f"patches.{rest.split('/')[0]}"
    if top == "edits":
        return "edits"
    return f"artifacts.{top.removeprefix('files-')}" if top.startswith("files-") else "files"


def _check_layout(root: Path, own: OverlayManifest) -> set[str]:
    """Listed files exist, nothing unlisted hides in the folder, no symlinks, diff headers name their file.

    Returns:
        The layout files the folder holds (relative to it).
    """
    expected = own.layout()
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
        raise OverlayError(f"{root / rel}: not listed in {MANIFEST}",
                           hint="list it (files, patches, edits or derived) or remove it")
    for base, per in own.patches.items():
        for p in per:
            _check_diff_headers(root / "patches" / base / f"{p}.diff", p)
    for p in own.edits:
        _check_diff_headers(root / "edits" / f"{p}.diff", p)
    for p, source in own.derived.items():
        _check_diff_headers(root / "edits" / f"{p}.diff", p, source)
    return present


def _check_diff_headers(diff: Path, path: str, source: str | None = None) -> None:
    """A diff patches exactly its own file: `--- a/<path>` (or a derived file's source) then `+++ b/<path>`,
    once."""
    lines = diff.read_text(errors="replace").splitlines()
    headers = [(old, new) for old, new in itertools.pairwise(lines) if old.startswith("--- ") and new.startswith("+++ ")]
    names = {(o[4:].split("\t")[0].strip(), n[4:].split("\t")[0].strip()) for o, n in headers}
    old = source or path
    if names != {(f"a/{old}", f"b/{path}")}:
        raise OverlayError(f"{diff}: headers must be '--- a/{old}' and '+++ b/{path}' (one file per diff), "
                           f"found {sorted(names) or 'none'}", hint="regenerate the diff from a pristine copy")


def versions_in(folder: Path) -> list[str]:
    """Version folders of one overlay holding a manifest, oldest first by semver (other names last)."""
    names = [p.name for p in folder.iterdir() if (p / MANIFEST).is_file()] if folder.is_dir() else []
    return sorted(names, key=semver_key)


def semver_key(text: str) -> tuple[int, Version | str]:
    """Sort key: versions by semver (PEP 440 orders releases alike), other names after them."""
    try:
        return (0, Version(text))
    except InvalidVersion:
        return (1, text)


# ---------------------------------------------------------------- export


class OverlayExport(BaseModel):
    """`overlay export`: the version written out and the files it holds."""

    overlay: str
    folder: str
    files: list[str]


def export(overlay: Overlay, target: Path) -> list[str]:
    """Write the resolved version into `target` as a folder of its own (no `inherits`): every file it
    lands, each patch, and the whole manifest. Tools that read a version folder directly (GNU patch
    by hand on the GPU machine, Ansible in the benchmark) take this.

    Returns:
        The files written, relative to `target`.
    Raises:
        OverlayError: `target` exists and is not an empty folder.
    """
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise OverlayError(f"{target}: exists and is not an empty folder", hint="export into a new folder")
    for rel, source in overlay.sources.items():
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target / rel)  # the mode too: an executable file stays executable
        if rel in overlay.edited:
            (target / rel).write_bytes(overlay.edited[rel])
    manifest = overlay.manifest.model_dump(mode="json", exclude={"inherits", "drops", "edits", "derived"})
    (target / MANIFEST).write_text(yaml.safe_dump(manifest, sort_keys=False, width=100))
    return [MANIFEST, *overlay.sources]
