"""The overlay catalog: the folders overlays are looked up in, finding `name[@version]`, listing them.

Folders are searched in order: `--overlays DIR`, `$DDTREE_OVERLAYS`, `./overlays` (in the current
directory), then the built-ins shipped in the package (`resources.builtin_dir`). The first folder
holding `<name>/` provides every version of that overlay, so a version and the parents it inherits
always come from one place. Nothing here touches a host.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from ddtree_deploy.errors import OverlayError
from ddtree_deploy.overlay import SEMVER, Overlay, read_overlay, versions_in
from ddtree_deploy.resources import builtin_dir

OVERLAYS_ENV = "DDTREE_OVERLAYS"
Origin = Literal["--overlays", "$DDTREE_OVERLAYS", "./overlays", "built-in"]


class OverlayFolder(BaseModel):
    """One folder of the search, and why it is searched."""

    path: Path
    origin: Origin


class OverlaySearch(BaseModel):
    """The folders overlays are looked up in, first first."""

    folders: list[OverlayFolder] = Field(default_factory=list)

    def names(self) -> dict[str, OverlayFolder]:
        """Every overlay name, with the folder that provides it (the first that holds it)."""
        found: dict[str, OverlayFolder] = {}
        for folder in self.folders:
            for entry in sorted(folder.path.iterdir()):
                if entry.is_dir() and versions_in(entry):
                    found.setdefault(entry.name, folder)
        return found

    def describe(self) -> str:
        return ", ".join(f"{f.path} ({f.origin})" for f in self.folders) or "no overlays folder"


def overlays_path(explicit: str | None = None) -> OverlaySearch:
    """The search: `--overlays DIR` (`explicit`), $DDTREE_OVERLAYS, ./overlays where it exists, the built-ins.

    Raises:
        OverlayError: a folder named by `--overlays` or $DDTREE_OVERLAYS is not a folder.
    """
    named: list[tuple[str | None, Origin]] = [(explicit, "--overlays"), (os.environ.get(OVERLAYS_ENV), "$DDTREE_OVERLAYS")]
    folders = [_named_folder(Path(text), origin) for text, origin in named if text]
    found: list[tuple[Path, Origin]] = [(Path("overlays"), "./overlays"), (builtin_dir("overlays"), "built-in")]
    for path, origin in found:
        if path.is_dir():
            folders.append(OverlayFolder(path=path.resolve(), origin=origin))
    unique = {f.path.resolve(): f for f in reversed(folders)}  # a folder met twice is searched where first met
    return OverlaySearch(folders=[f for f in folders if unique[f.path.resolve()] is f])


def _named_folder(path: Path, origin: Origin) -> OverlayFolder:
    if not path.is_dir():
        raise OverlayError(f"no overlays folder {path} (from {origin})", code="unknown_overlay",
                           hint=f"pass --overlays DIR, set {OVERLAYS_ENV} to a folder, or unset it for the built-ins")
    return OverlayFolder(path=path.resolve(), origin=origin)


def _search(overlays: OverlaySearch | Path | None) -> OverlaySearch:
    """A search as given; a bare folder is searched alone; None is the default search."""
    if isinstance(overlays, Path):
        return OverlaySearch(folders=[_named_folder(overlays, "--overlays")])
    return overlays_path(None) if overlays is None else overlays


def parse_spec(spec: str) -> tuple[str, str | None]:
    name, _, version = spec.partition("@")
    return name, (version or None)


def load_overlay(spec: str, overlays: OverlaySearch | Path | None = None) -> Overlay:
    """Load `name@version`, or `name`'s default version (`default_version`), resolved through its parents.

    Raises:
        OverlayError: unknown name or version (listing the known ones), or anything `read_overlay`
            refuses (naming the file and field).
    """
    search = _search(overlays)
    name, version = parse_spec(spec)
    known = search.names()
    if name not in known:
        raise OverlayError(f"no overlay {name!r} in {search.describe()}", code="unknown_overlay",
                           hint=f"known overlays: {', '.join(sorted(known))}" if known
                           else f"pass --overlays DIR or set {OVERLAYS_ENV}")
    folder = known[name].path / name
    versions = versions_in(folder)
    if version is None:
        version = default_version(versions)
    elif version not in versions:
        raise OverlayError(f"no version {version} of overlay {name} in {folder.parent}", code="unknown_overlay",
                           hint=f"known versions: {', '.join(versions)}")
    return read_overlay(folder / version)


def default_version(versions: list[str]) -> str:
    """What a bare `name` means: the newest release, as pip picks one; a pre-release (`0.3.0-rc.1`, a
    version not yet proven where it runs) only when it is named, or when no release exists."""
    releases = [v for v in versions if not _prerelease(v)]
    return (releases or versions)[-1]


def _prerelease(version: str) -> bool:
    """A semver pre-release (`-rc.1`, `-hybrid.1`: whatever follows the `-`), also one PEP 440 cannot read."""
    match = re.match(SEMVER, version)
    return match is None or match.group(4) is not None


class OverlayListing(BaseModel):
    """One row of `overlay list`."""

    name: str
    version: str
    inherits: str | None = Field(default=None, description="the version it is built on")
    folder: str = Field(description="the overlays folder it came from")
    origin: Origin
    description: str = ""
    bases: list[str] = Field(default_factory=list)
    files: int = Field(default=0, description="whole files it lands, inherited ones included")
    patches: int = 0
    holds: int = Field(default=0, description="files in its own folder (what it changes from its parent)")
    artifacts: list[str] = Field(default_factory=list)
    default: bool = Field(default=False, description="what a push of the bare name takes (the newest release)")
    error: str | None = None


def list_overlays(overlays: OverlaySearch | Path | None = None) -> list[OverlayListing]:
    """Every overlay version the search provides, by name then semver; an invalid one carries its error."""
    rows = []
    for name, folder in sorted(_search(overlays).names().items()):
        versions = versions_in(folder.path / name)
        for version in versions:
            is_default = version == default_version(versions)
            try:
                overlay = read_overlay(folder.path / name / version)
            except OverlayError as exc:
                rows.append(OverlayListing(name=name, version=version, folder=str(folder.path), origin=folder.origin,
                                           default=is_default, error=str(exc)))
                continue
            m = overlay.manifest
            rows.append(OverlayListing(
                name=m.name, version=m.version, inherits=m.inherits, folder=str(folder.path), origin=folder.origin,
                description=m.description.strip(), bases=m.target.bases, files=len(m.files),
                patches=sum(len(per) for per in m.patches.values()), holds=len(overlay.held),
                artifacts=sorted(m.artifacts), default=is_default))
    return rows


class OverlayList(BaseModel):
    """`overlay list`: the folders searched, in order, and every version they provide."""

    folders: list[OverlayFolder]
    overlays: list[OverlayListing]
