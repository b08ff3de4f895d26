"""No released file is a byte copy of another: across every version folder of the repository (the
shipped overlays, the sandbox's and the tests'), each file under files*/ and patches/ is unique."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.overlay.plan_digests import FOLDERS, REPO


def test_no_two_overlay_files_have_the_same_bytes() -> None:
    seen: dict[str, Path] = {}
    payload = [path for folder in FOLDERS for path in sorted((REPO / folder).glob("*/*/*/**/*"))
               if path.is_file() and "__pycache__" not in path.parts
               and path.relative_to(REPO / folder).parts[2].startswith(("files", "patches"))]
    assert len(payload) > 10
    for path in payload:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert digest not in seen, f"{path.relative_to(REPO)} is a byte copy of {seen[digest].relative_to(REPO)}"
        seen[digest] = path
