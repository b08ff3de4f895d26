"""Applying one unified diff to one file's bytes with GNU `patch` (no fuzz), and the conflicts it reports.

Both the plan (an overlay's patches on a host's pristine files) and the overlay loader (a version's
edits of its parent's files) patch through here, in a temporary folder: never a hand-written diff parser.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from pydantic import BaseModel

from ddtree_deploy.errors import OverlayError
from ddtree_deploy.scratch import scratch_dir


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
    with scratch_dir("patch") as tmp:
        target = Path(tmp, path)
        target.parent.mkdir(parents=True)
        target.write_bytes(pristine)
        proc = subprocess.run(
            [patch, "-p1", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch", "--reject-file=-",
             "--quoting-style=literal", "-d", str(tmp), "-i", str(diff.resolve())],
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
