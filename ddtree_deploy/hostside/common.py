"""Shared host-side plumbing: the op context, failures, atomic writes and the state layout.

Also the test hook that pauses an op at a named point. State layout (DESIGN.md section 5), under
`<state_base>/<env-id>/`, mode 0700:
objects/, snapshots/, state.json, journal.json, lock, history.jsonl, server/.
The env-id is derived from the real path of the environment (`sys.prefix`) and of the package
root, so two environments on one host, or two `pip --target` folders used by one python, never mix.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import tempfile
import time
from typing import IO, Any, Callable, Dict, List, Optional, Tuple, TypeVar


class HelperFailure(Exception):
    """An op refuses: reported as {"ok": false, "error": {code, message, hint}}."""

    def __init__(self, code: str, message: str, hint: str = "", **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint
        self.details = details


def os_failure(exc: OSError, what: str) -> HelperFailure:
    """A staging failure, said plainly: nothing on the host was changed."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        code, hint = "disk_full", "free space on the host (package folder and state folder) and retry"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        code, hint = "read_only", "make the folder writable for the deploying user and retry"
    else:
        code, hint = "os_error", "check the host's file system"
    where = "%s: " % exc.filename if exc.filename else ""
    return HelperFailure(
        code,
        "%s failed, nothing was changed: %s%s" % (what, where, exc.strerror or exc),
        hint,
        errno=exc.errno,
    )


class Context:
    """What every op needs: the package root and this environment's state directory."""

    def __init__(self, request: Dict[str, Any]) -> None:
        self.package_root = find_package_root(request.get("package_root"), request.get("package", "sglang"))
        base = os.path.expanduser(request.get("state_base") or "~/.local/state/ddtree-deploy")
        self.env_id = env_id(self.package_root)
        self.state_dir = os.path.join(base, self.env_id)
        self.owner = str(request.get("owner") or "")

    def path(self, *parts: str) -> str:
        return os.path.join(self.state_dir, *parts)

    def ensure_state_dir(self) -> None:
        for sub in ("", "objects", "snapshots", "server"):
            os.makedirs(self.path(sub), mode=0o700, exist_ok=True)
        os.chmod(self.state_dir, 0o700)


def find_package_root(explicit: Optional[str], package: str) -> str:
    """The folder that holds `<package>/`: given explicitly, else the first on this python's sys.path."""
    if explicit:
        root = os.path.abspath(os.path.expanduser(explicit))
        if not os.path.isdir(os.path.join(root, package)):
            raise HelperFailure("package_not_found", "package root %s has no %s/ folder" % (root, package),
                                "fix the host's package_root in the inventory")
        return root
    for entry in sys.path:
        if entry and os.path.isfile(os.path.join(entry, package, "__init__.py")):
            return os.path.abspath(entry)
    raise HelperFailure("package_not_found", "%s is not installed for %s" % (package, sys.executable),
                        "set the host's python or package_root in the inventory")


def env_id(package_root: str) -> str:
    key = os.path.realpath(sys.prefix) + "\0" + os.path.realpath(package_root)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


TEMP_PREFIX = ".ddtree-tmp-"
T = TypeVar("T")


def staged_file(folder: str, mode: int, fill: Callable[[IO[bytes]], T], durable: bool = True) -> Tuple[str, T]:
    """A temp file in `folder` written by `fill`, fsynced if durable, with `mode`: (its path, what `fill`
    returned). Removed again if anything fails, `fill`'s own refusal included."""
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            filled = fill(out)
            out.flush()
            if durable:
                os.fsync(out.fileno())
        os.chmod(tmp, mode)
        return tmp, filled
    except BaseException as exc:
        os.unlink(tmp)
        name_the_folder(exc, folder)
        raise


def name_the_folder(exc: BaseException, folder: str) -> None:
    """A failed write or fsync names no file (ENOSPC from write(2) has none): say where it was writing."""
    if isinstance(exc, OSError) and not exc.filename:
        exc.filename = folder


def staged_bytes(data: bytes, folder: str, mode: int) -> str:
    """A fsynced temp file with `data` and `mode` in `folder` (removed again if anything fails)."""
    return staged_file(folder, mode, lambda out: out.write(data))[0]


def atomic_write(path: str, data: bytes, mode: int = 0o600) -> None:
    """Temp file in the same folder, fsync, rename: a reader sees the old or the new bytes, never half."""
    folder = os.path.dirname(path) or "."
    tmp = staged_bytes(data, folder, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_dir(folder)


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_json(path: str, value: Any) -> None:
    atomic_write(path, json.dumps(value, indent=1, sort_keys=True).encode())


def read_json(path: str, default: Any = None) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return default


#: the records a damaged copy of must be named, never read as absent by an op that changes the host
RECORDS = ("state.json", "journal.json")
DAMAGED_HINT = "restore a snapshot with `ddtree-deploy rollback --host HOST --to SNAPSHOT` (the store is intact), " \
               "which rewrites it; `ddtree-deploy snapshots --host HOST` lists them"


def read_record_or_damage(ctx: Context, name: str) -> Tuple[Optional[Dict[str, Any]], Optional[Dict[str, str]]]:
    """state.json or journal.json: (its mapping or None when absent, None) or, when it is not a JSON
    mapping (a disk that filled mid-write, a hand edit), (None, {file, path, error})."""
    path = ctx.path(name)
    try:
        value = read_json(path)
    except ValueError as exc:
        return None, {"file": name, "path": path, "error": "not valid JSON (%s)" % exc}
    if value is not None and not isinstance(value, dict):
        return None, {"file": name, "path": path, "error": "not a JSON object"}
    return value, None


def damaged_failure(damage: Dict[str, str], known: Optional[List[str]] = None) -> HelperFailure:
    """The refusal of an op that needs a record that cannot be read: code state_damaged, naming the file."""
    hint = DAMAGED_HINT + ("; known snapshots (newest last): %s" % ", ".join(known) if known else "")
    return HelperFailure("state_damaged", "%s is damaged: %s" % (damage["path"], damage["error"]), hint,
                         damaged=damage, known=known or [])


def read_record(ctx: Context, name: str) -> Optional[Dict[str, Any]]:
    """state.json or journal.json (None when absent); a damaged one is refused as state_damaged, by name."""
    value, damage = read_record_or_damage(ctx, name)
    if damage is not None:
        raise damaged_failure(damage)
    return value


def append_history(ctx: Context, event: Dict[str, Any]) -> None:
    line = json.dumps(dict(event, time=time.time()), sort_keys=True) + "\n"
    fd = os.open(ctx.path("history.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def pause_point(point: str) -> None:
    """Test hook: with DDTREE_TEST_PAUSE_AT=<point>, note our pid and sleep so a test can SIGKILL us here."""
    if os.environ.get("DDTREE_TEST_PAUSE_AT") != point:
        return
    signal_file = os.environ.get("DDTREE_TEST_PAUSE_SIGNAL")
    if signal_file:
        with open(signal_file, "w") as f:
            f.write(str(os.getpid()))
    time.sleep(float(os.environ.get("DDTREE_TEST_PAUSE_S", "60")))
