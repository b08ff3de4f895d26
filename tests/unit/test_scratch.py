"""Scratch folders a killed controller leaves (`ddtree-patch-*`) are removed by the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ddtree_deploy import scratch

HOLD = ("import time; from ddtree_deploy.scratch import scratch_dir\n"
        "with scratch_dir('patch') as d:\n    print(d, flush=True); time.sleep(60)")


def aged(path: Path) -> Path:
    old = path.stat().st_mtime - 2 * scratch.MIN_AGE_S
    os.utime(path, (old, old))
    return path


def test_the_folder_of_a_killed_process_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.stdout is not None
    killed = Path(proc.stdout.readline().strip())
    assert killed.parent == tmp_path and killed.name.startswith(f"ddtree-patch-{proc.pid}-")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert killed.is_dir()  # no finally ran
    live = aged(Path(tempfile.mkdtemp(prefix=f"ddtree-patch-{os.getpid()}-", dir=tmp_path)))
    fresh = Path(tempfile.mkdtemp(prefix=f"ddtree-patch-{proc.pid}-", dir=tmp_path))  # maybe another pid namespace's
    legacy = aged(Path(tempfile.mkdtemp(prefix="ddtree-patch-", dir=tmp_path)))  # named before names had pids
    other_kind = aged(Path(tempfile.mkdtemp(prefix=f"ddtree-compile-{proc.pid}-", dir=tmp_path)))
    aged(killed)
    assert sorted(scratch.sweep("patch", root=tmp_path)) == sorted([killed, legacy])
    assert live.is_dir() and fresh.is_dir() and other_kind.is_dir()


def test_the_first_scratch_folder_of_a_process_sweeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(scratch, "_swept", set())
    left = aged(Path(tempfile.mkdtemp(prefix="ddtree-patch-999999999-", dir=tmp_path)))
    with scratch.scratch_dir("patch") as folder:
        assert folder.name.startswith(f"ddtree-patch-{os.getpid()}-") and not left.exists()
    assert not folder.exists()
