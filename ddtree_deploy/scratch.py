"""Scratch folders in the temp directory, named by their process, and the sweep of those a killed one left.

`tempfile.TemporaryDirectory` removes its folder when the block ends, but not when the process is
killed (SIGKILL; SIGTERM's default action runs no `finally` either), and a plan runs GNU patch in
one folder per patched file. So each folder's name carries its pid (`ddtree-patch-<pid>-<random>`),
and the first folder of a kind that a process makes removes the folders of that kind whose process
is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: a folder younger than this is never swept: its pid may belong to another pid namespace sharing /tmp
MIN_AGE_S = 60.0

_swept: set[str] = set()


@contextmanager
def scratch_dir(kind: str) -> Iterator[Path]:
    """A fresh folder `ddtree-<kind>-<pid>-*` in the temp directory, removed when the block ends."""
    if kind not in _swept:
        _swept.add(kind)
        sweep(kind)
    with tempfile.TemporaryDirectory(prefix=f"ddtree-{kind}-{os.getpid()}-") as folder:
        yield Path(folder)


def sweep(kind: str, root: Path | None = None, min_age_s: float = MIN_AGE_S) -> list[Path]:
    """Remove our `ddtree-<kind>-*` folders under `root` (the temp directory) whose process is gone.

    A folder named before names carried a pid (`ddtree-patch-<random>`) counts as gone once it is
    `min_age_s` old, as does every folder swept: a plan's folder lives for well under a second.
    """
    removed = []
    pattern = re.compile(rf"ddtree-{re.escape(kind)}-(?:(\d+)-)?[^/]+")
    for path in (root or Path(tempfile.gettempdir())).glob(f"ddtree-{kind}-*"):
        match = pattern.fullmatch(path.name)
        try:
            st = path.lstat()
        except OSError:
            continue
        if not match or not path.is_dir() or st.st_uid != os.getuid() or time.time() - st.st_mtime < min_age_s:
            continue
        if match.group(1) is None or not _alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
