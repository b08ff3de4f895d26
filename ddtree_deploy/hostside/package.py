"""The installed package on disk: which folders make it up, checked package-relative paths, and scanning it.

The package is the `sglang/` folder plus its `sglang-<version>.dist-info/` in the package root;
`__pycache__` folders are derived data and never part of it. A scan lists every file with its
sha256, mode and size (a symlink with its target) and every folder with its mode; the stat cache
(`snapshots/statcache.json`: (size, mtime_ns, ctime_ns, inode) -> sha256, like git's index) spares
re-reading the files that did not change.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .common import Context, HelperFailure, atomic_write, read_json
from .objects import hash_file

PACKAGE = "sglang"
DIST_INFO = re.compile(r"^%s-[0-9][^-/]*\.dist-info$" % PACKAGE)
DERIVED_DIRS = ("__pycache__",)
#: entries modified this close to a scan are re-hashed next time (git's "racily clean" rule)
RACY_NS = 2 * 10**9

Entry = Dict[str, Any]  # {"sha256", "mode", "size"} or {"link", "mode", "size", "sha256"}
Reader = Callable[[str, os.stat_result], str]  # hashes a file the stat cache cannot answer for


def package_dirs(root: str) -> List[str]:
    """The top-level folders that make up the package: sglang/ and its dist-info."""
    names = [PACKAGE] if os.path.isdir(os.path.join(root, PACKAGE)) else []
    return names + sorted(
        n for n in os.listdir(root) if DIST_INFO.match(n) and os.path.isdir(os.path.join(root, n))
    )


def checked_path(ctx: Context, rel: Any) -> str:
    """Absolute path of package-relative `rel`; refused if it escapes the package (.., absolute, symlinks)."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        raise HelperFailure(
            "path_escapes",
            "path %r is not relative to the package root" % (rel,),
            "paths are relative to the folder holding sglang/",
            path=rel,
        )
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts) or (parts[0] != PACKAGE and not DIST_INFO.match(parts[0])):
        raise HelperFailure(
            "path_escapes",
            "path %r is outside the %s package" % (rel, PACKAGE),
            "paths must stay under sglang/ or its dist-info",
            path=rel,
        )
    full = os.path.join(ctx.package_root, rel)
    root = os.path.realpath(ctx.package_root)
    if not os.path.realpath(os.path.dirname(full)).startswith(root + os.sep):
        raise HelperFailure(
            "path_escapes",
            "%s: a folder on the way is a symlink leading outside %s" % (rel, root),
            "remove the symlink on the host",
            path=rel,
        )
    if os.path.islink(full) and not os.path.realpath(full).startswith(root + os.sep):
        raise HelperFailure(
            "path_escapes",
            "%s is a symlink to %s, outside the package root" % (rel, os.path.realpath(full)),
            "remove the symlink on the host",
            path=rel,
        )
    return full


def link_entry(path: str, st: os.stat_result) -> Entry:
    target = os.readlink(path)
    return {
        "link": target,
        "sha256": hashlib.sha256(target.encode()).hexdigest(),
        "mode": stat.S_IMODE(st.st_mode),
        "size": len(target),
    }


def walk_package(root: str) -> Iterator[Tuple[str, Optional[os.stat_result]]]:
    """(relpath, lstat) of every file and symlink, (relpath/, None) of every folder; no __pycache__."""
    stack = [d for d in reversed(package_dirs(root))]
    while stack:
        rel = stack.pop()
        yield rel + "/", None
        with os.scandir(root + "/" + rel) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in reversed(entries):
            child = rel + "/" + entry.name  # not os.path.join: this runs per file
            if entry.is_dir(follow_symlinks=False):
                if entry.name not in DERIVED_DIRS:
                    stack.append(child)
            else:  # temp files left by a killed run are listed too: restore removes them
                yield child, entry.stat(follow_symlinks=False)


class StatCache:
    """sha256 by (size, mtime_ns, ctime_ns, inode): a file whose stat is unchanged is not read again."""

    def __init__(self, ctx: Context) -> None:
        self.path = ctx.path("snapshots", "statcache.json")
        loaded = read_json(self.path, default=None) or {}
        self.entries = loaded.get("entries", {}) if loaded.get("root") == ctx.package_root else {}
        self.fresh: Dict[str, List[Any]] = {}
        self.started_ns = time.time_ns()

    def sha(self, full: str, rel: str, st: os.stat_result, force: bool = False, read: Optional[Reader] = None) -> str:
        key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        cached = self.entries.get(rel)
        if not force and cached and cached[:4] == key:
            sha = str(cached[4])
        else:
            sha = read(full, st) if read else hash_file(full)
        if st.st_mtime_ns < self.started_ns - RACY_NS:
            self.fresh[rel] = key + [sha]
        return sha

    def save(self, ctx: Context) -> None:
        if self.fresh != self.entries and os.path.isdir(os.path.dirname(self.path)):
            body = {"root": ctx.package_root, "entries": self.fresh}
            atomic_write(self.path, json.dumps(body, separators=(",", ":")).encode())


def scan(
    ctx: Context, cache: StatCache, rehash: Tuple[str, ...] = (), read: Optional[Reader] = None
) -> Tuple[Dict[str, Entry], Dict[str, int]]:
    """Every file of the package with its hash, mode and size, and every folder with its mode.

    `read` hashes the files the stat cache cannot answer for (default: `hash_file`).
    """
    files: Dict[str, Entry] = {}
    dirs: Dict[str, int] = {}
    prefix = len(ctx.package_root) + 1

    def sha_of(full: str, st: os.stat_result) -> str:
        rel = full[prefix:]
        return cache.sha(full, rel, st, force=rel in rehash, read=read)

    for rel, st in walk_package(ctx.package_root):
        full = ctx.package_root + "/" + rel
        if st is None:
            dirs[rel.rstrip("/")] = stat.S_IMODE(os.lstat(full).st_mode)
            continue
        entry = entry_of(full, st, sha_of)
        if entry is not None:
            files[rel] = entry
    return files, dirs


def entry_of(full: str, st: os.stat_result, sha_of: Callable[[str, os.stat_result], str]) -> Optional[Entry]:
    """A file's manifest entry (hash, mode, size; a symlink's target); None for anything else (a socket)."""
    if stat.S_ISLNK(st.st_mode):
        return link_entry(full, st)
    if stat.S_ISREG(st.st_mode):
        return {"sha256": sha_of(full, st), "mode": stat.S_IMODE(st.st_mode), "size": st.st_size}
    return None


def sha_of_file(full: str, st: os.stat_result) -> str:
    return hash_file(full)


def path_entry(full: str, sha_of: Callable[[str, os.stat_result], str]) -> Optional[Entry]:
    """One path's manifest entry as it is now; None if it is absent (or not a file or symlink)."""
    st = lstat_or_none(full)
    return entry_of(full, st, sha_of) if st is not None else None


def lstat_or_none(path: str) -> Optional[os.stat_result]:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
