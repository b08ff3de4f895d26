"""The controller's private runtime folder: where its sockets live (fork server, SSH control masters).

`$XDG_RUNTIME_DIR/ddtree-deploy`, else `$TMPDIR/ddtree-deploy-UID`; made mode 0700 and refused
unless this user alone can open it, because whoever can reach these sockets can run commands as us.
Standard library only: the fork server's client imports it before anything else.
"""

from __future__ import annotations

import os
from pathlib import Path


def private_folder(*parts: str) -> Path | None:
    """The folder (and `parts` below it, made 0700 too); None where no safe folder can be had."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "ddtree-deploy" if runtime else Path(os.environ.get("TMPDIR") or "/tmp") / f"ddtree-deploy-{os.getuid()}"
    folder = base.joinpath(*parts)
    for path in [base, *(base.joinpath(*parts[:n]) for n in range(1, len(parts) + 1))]:
        try:
            path.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(path)
        except OSError:
            return None
        if st.st_uid != os.getuid() or (st.st_mode & 0o077) or os.path.islink(path):
            return None  # someone else's folder in /tmp could hand our commands to their server
    return folder
