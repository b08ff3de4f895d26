"""Pristine sglang releases and the overlay check against them (how an overlay is rebased).

`pristine_release` downloads a release once with `pip download --no-deps` into a cache and unpacks
it; `check_overlay` applies every patch set of an overlay to the release it names, reports each
conflict by file and hunk, and byte-compiles the result.
"""

from __future__ import annotations

import hashlib
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pydantic import BaseModel, Field

from ddtree_deploy.errors import OverlayError
from ddtree_deploy.overlay import PACKAGE, Overlay, semver_key
from ddtree_deploy.patching import Conflict, apply_patch
from ddtree_deploy.scratch import scratch_dir

CACHE_ENV = "DDTREE_DEPLOY_CACHE"




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
    """`overlay check`: one check per version, ok when every one applies and compiles."""

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
    patches_from = base if base in supported else max(supported, key=semver_key)
    pre_images = overlay.require_base(patches_from)
    conflicts: list[Conflict] = []
    notes: list[str] = []
    result: dict[str, bytes] = {p: overlay.content_of(p, None) for p in overlay.manifest.files}
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
    with scratch_dir("compile") as tmp:
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


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
