"""What a push of each overlay version lands on a pristine sglang host: every path, mode and sha256.

`plan_digests.json` beside this file was written by `PYTHONPATH=. python3 tests/overlay/plan_digests.py
--write` before the overlays moved to inheritance; test_plan_digests.py recomputes it, so a change to
how versions are stored cannot change the bytes a push writes.
"""

from __future__ import annotations

import hashlib
import json
import stat
import sys
from pathlib import Path

from ddtree_deploy.catalog import load_overlay
from ddtree_deploy.plan import HostFile, facts_needed, plan
from ddtree_deploy.pristine import pristine_release

REPO = Path(__file__).resolve().parents[2]
DIGESTS = Path(__file__).with_name("plan_digests.json")
BASE = "0.5.17"
# Every folder of overlays in the repository (the shipped ones, the sandbox's, the tests').
FOLDERS = ["overlays", "sandbox/overlays", *sorted(p.relative_to(REPO).as_posix()
                                                   for p in REPO.glob("tests/*/overlays"))]


def pristine_facts(release: Path, path: str) -> HostFile:
    """`path` as a host holding the pristine release describes it, content included."""
    file = release / path
    if not file.is_file():
        return HostFile(exists=False)
    data = file.read_bytes()
    return HostFile(exists=True, sha256=hashlib.sha256(data).hexdigest(), mode=stat.S_IMODE(file.stat().st_mode),
                    size=len(data), content=data)


def landed(folder: Path, spec: str, release: Path) -> dict[str, object]:
    """The plan's digest (recorded in the host's state) and `path: "<action> <mode> <sha256>"` for every
    change a push of `spec` makes on the pristine release (pip's RECORD among them)."""
    overlay = load_overlay(spec, folder)
    facts = {path: pristine_facts(release, path) for path in facts_needed(overlay, BASE)}
    result = plan(overlay, BASE, facts)
    files = {c.path: f"{c.action} {c.mode:o} {c.after}" for c in result.changes if c.mode is not None}
    return {"plan_digest": result.digest, "files": files}


def every_version() -> list[tuple[str, str]]:
    """(folder, name@version) of every overlay version folder in the repository."""
    return [(folder, f"{name.name}@{version.name}") for folder in FOLDERS
            for name in sorted((REPO / folder).iterdir()) if name.is_dir()
            for version in sorted(name.iterdir()) if (version / "overlay.yaml").is_file()]


def compute() -> dict[str, dict[str, object]]:
    release = pristine_release(BASE)
    out: dict[str, dict[str, object]] = {}
    for folder, spec in every_version():
        out[f"{folder}/{spec}"] = landed(REPO / folder, spec, release)
    return out


if __name__ == "__main__":
    text = json.dumps(compute(), indent=1, sort_keys=True) + "\n"
    if sys.argv[1:] == ["--write"]:
        DIGESTS.write_text(text)
    else:
        sys.stdout.write(text)
