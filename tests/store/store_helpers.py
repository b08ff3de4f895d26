"""Helpers for the store tests that are not fixtures: tree hashes, stored objects, tmpfs mounts, filling a disk."""

from __future__ import annotations

import base64
import errno
import hashlib
import importlib.metadata
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddtree_deploy.hostside import locks, objects, store, transactions
from ddtree_deploy.hostside.common import Context, read_json
from ddtree_deploy.inventory import HostSpec
from ddtree_deploy.overlay import Overlay
from ddtree_deploy.plan import HostFile, Plan, facts_needed, plan
from ddtree_deploy.transport import LocalTransport

OVERLAYS = Path(__file__).parent / "overlays"
SMALL_FILES = ["sglang/__init__.py", "sglang/version.py", "sglang/srt/server_args.py",
               "sglang/srt/speculative/spec_utils.py", "sglang/srt/speculative/spec_info.py",
               "sglang-0.5.17.dist-info/METADATA", "sglang-0.5.17.dist-info/RECORD"]

@dataclass
class LocalHost:
    """A host of a local inventory: the inventory file, its package root, a transport to its helper."""

    inventory: Path
    site: Path
    transport: LocalTransport


def only_result(out: Any) -> dict[str, Any]:
    """The one host row's result of a fleet command's `--json` envelope (a `CliOutcome`)."""
    (row,) = out.json["data"]["hosts"]
    assert row["error"] is None, row
    result: dict[str, Any] = row["result"]
    return result


def tree_state(root: Path) -> dict[str, Any]:
    """(sha256, mode) of every file, and mode of every folder, of sglang/ and its dist-info (__pycache__ skipped)."""
    out: dict[str, Any] = {}
    for top in sorted(p for p in root.iterdir() if p.name == "sglang" or p.name.endswith(".dist-info")):
        for folder, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel_folder = Path(folder).relative_to(root).as_posix()
            out[rel_folder + "/"] = stat.S_IMODE(os.lstat(folder).st_mode)
            for name in files:
                path = Path(folder, name)
                out[f"{rel_folder}/{name}"] = (hashlib.sha256(path.read_bytes()).hexdigest(),
                                               stat.S_IMODE(path.lstat().st_mode))
    return out


def pip_listing(site: Path) -> tuple[set[str], list[str]]:
    """What pip's RECORD lists for sglang (read by importlib.metadata, as pip reads it), and every listed
    file on disk whose hash or size differs (a test site may hold only some of the package's files)."""
    dist = importlib.metadata.Distribution.at(site / "sglang-0.5.17.dist-info")
    listed, wrong = set(), []
    for entry in dist.files or []:
        listed.add(entry.as_posix())
        if entry.hash is not None and (site / entry).is_file():
            data = (site / entry).read_bytes()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")
            if (entry.hash.mode, entry.hash.value, entry.size) != ("sha256", digest, len(data)):
                wrong.append(entry.as_posix())
    return listed, wrong


def stored_objects(ctx: Context) -> dict[str, list[str]]:
    """Where each stored content sits: the loose objects under "loose", each pack's under its file name."""
    store = objects.ObjectStore(ctx)
    places: dict[str, list[str]] = {}
    loose = [prefix + name for prefix in sorted(os.listdir(store.root)) if len(prefix) == 2
             for name in sorted(os.listdir(os.path.join(store.root, prefix)))] if os.path.isdir(store.root) else []
    if loose:
        places["loose"] = loose
    for pack, index in store.packs():
        places[os.path.basename(pack)] = sorted(index)
    return places


def object_count(ctx: Context) -> int:
    return sum(len(shas) for shas in stored_objects(ctx).values())


def corrupt_object(ctx: Context, sha: str) -> None:
    """Flip one byte of stored content `sha`, where it sits (pack or loose file); a second call flips it back."""
    stored = objects.ObjectStore(ctx)
    path, offset, _ = stored.packed.get(sha) or (stored.loose_path(sha), 0, 0)
    data = bytearray(Path(path).read_bytes())
    data[offset + 100] ^= 0x20
    os.chmod(path, 0o600)
    Path(path).write_bytes(bytes(data))


def folder_listing(root: Path) -> dict[str, int]:
    """Every file (with its size) and folder (-1) under `root`: to show a failed op left nothing behind."""
    return {p.relative_to(root).as_posix(): p.stat().st_size if p.is_file() else -1 for p in root.rglob("*")}


@contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` at `folder` (we run as root); fails loudly if it cannot be mounted."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path, leave_bytes: int) -> None:
    """Fill the file system of `folder` until about `leave_bytes` remain free."""
    free = shutil.disk_usage(folder).free
    with open(folder / "filler", "wb") as f:
        try:
            f.write(b"\0" * max(free - leave_bytes, 0))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def remount_ro(folder: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)


def build_small_site(pristine: Path, target: Path) -> Path:
    for rel in SMALL_FILES:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pristine / rel, target / rel)
    return target


def make_ctx(site: Path, state: Path, *, locked: bool = True) -> Context:
    """The helper context of owner "tests", which holds the host lock (as after a controller's preflight) unless
    `locked` is false: the ops that change the host refuse a caller without it."""
    ctx = Context({"package_root": str(site), "state_base": str(state), "owner": "tests"})
    if locked:
        locks.lock(ctx, {"owner": "tests"})
    return ctx


def local_transport(site: Path, state: Path, *, locked: bool = True) -> LocalTransport:
    """A transport of owner "tests" to the helper for `site`, holding the host lock unless `locked` is false."""
    spec = HostSpec(name="sbx", transport="local", python=sys.executable, package_root=str(site),
                    state_dir=str(state))
    transport = LocalTransport(spec, owner="tests")
    if locked:
        transport.call("lock", {"owner": "tests"})
    return transport


def plan_in_process(ctx: Context, overlay: Overlay, base: str = "0.5.17") -> Plan:
    """What `steps.plan_for_host` does, with the helper's ops called in-process."""
    deployed = read_json(ctx.path("state.json")) or {}
    owned = sorted(deployed.get("files") or {}) if deployed.get("overlay") else []
    base_snapshot = deployed.get("base_snapshot") if deployed.get("overlay") else None
    paths = facts_needed(overlay, base, owned)
    answer = store.read_files(ctx, {"paths": paths, "want_content": paths, "snapshot": base_snapshot})
    facts = {p: HostFile.from_helper(f) for p, f in answer["files"].items()}
    return plan(overlay, base, facts, deployed_paths=owned, base_snapshot=base_snapshot, host="sbx")


def push_in_process(ctx: Context, overlay: Overlay) -> tuple[Plan, str]:
    """plan -> snapshot -> apply, as the push playbook orders them; returns the plan and the snapshot id."""
    the_plan = plan_in_process(ctx, overlay)
    snap = store.snapshot(ctx, {"reason": "pre-push"})["id"]
    transactions.apply(ctx, the_plan.helper_args(snap))
    return the_plan, snap


def run_and_kill(work: Callable[[], object], point: str, tmp_path: Path) -> None:
    """Run `work` as a forked controller in its own session, its helper pausing at `point`; SIGKILL the session there."""
    signal_file = tmp_path / f"paused-{point.replace(':', '-')}"
    pid = os.fork()
    if pid == 0:  # the controller: its helper subprocess inherits the pause settings
        status = 1
        try:
            os.setsid()
            os.environ.update(DDTREE_TEST_PAUSE_AT=point, DDTREE_TEST_PAUSE_SIGNAL=str(signal_file),
                              DDTREE_TEST_PAUSE_S="120")
            work()
            status = 0
        finally:
            os._exit(status)
    deadline = time.monotonic() + 60
    while not signal_file.exists():
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            pytest.fail(f"controller ended (status {status}) before its helper paused at {point}")
        assert time.monotonic() < deadline, f"helper never reached {point}"
        time.sleep(0.02)
    os.killpg(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
