"""tools/gpu/apply_overlay.sh (patching a package by hand on the GPU machine) lands the bytes a push
lands, for a version that inherits most of them, on a python without the SSH stack, and a version's
derived files as the loader resolves them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ddtree_deploy.catalog import load_overlay
from ddtree_deploy.pristine import pristine_release
from tests.overlay.plan_digests import BASE, DIGESTS, REPO

# Makes `import fabric` (and paramiko, invoke) fail, as on the GPU machine.
NO_SSH_STACK = """
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fabric", "paramiko", "invoke"):
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, _Absent())
"""


@pytest.mark.parametrize("spec", ["ddtree@0.2.2", "ddtree@0.2.0"])
def test_apply_overlay_lands_the_pushed_bytes_without_the_ssh_stack(tmp_path: Path, spec: str) -> None:
    landed = json.loads(DIGESTS.read_text())[f"overlays/{spec}"]["files"]
    release, root = pristine_release(BASE), tmp_path / "site"
    for path, change in landed.items():
        if change.startswith("write") and not path.endswith("RECORD"):  # the files the patches rewrite
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(release / path, root / path)
    (tmp_path / "nossh").mkdir()
    (tmp_path / "nossh" / "sitecustomize.py").write_text(NO_SSH_STACK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "nossh")}
    name, version = spec.split("@")
    proc = subprocess.run(["bash", str(REPO / "tools/gpu/apply_overlay.sh"), f"overlays/{name}/{version}", str(root)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"applied {spec} to {root} (3 patches)"
    for path, change in landed.items():
        if not path.endswith("RECORD"):
            assert hashlib.sha256((root / path).read_bytes()).hexdigest() == change.split()[-1], path


def test_apply_overlay_lands_a_versions_derived_files(tmp_path: Path) -> None:
    """0.3.0-rc.18 ships two files derived from an inherited one (`derived:`): they land whole, as the
    loader resolves them, beside the version's other files and patches."""
    overlay = load_overlay("ddtree@0.3.0-rc.18", REPO / "overlays")
    release, root = pristine_release(BASE), tmp_path / "site"
    for path in overlay.manifest.patches[BASE]:  # the pristine files the patches rewrite
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(release / path, root / path)
    proc = subprocess.run(["bash", str(REPO / "tools/gpu/apply_overlay.sh"), "overlays/ddtree/0.3.0-rc.18", str(root)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    derived = ["sglang/srt/speculative/ddtree_tree.py", "sglang/srt/speculative/ddtree_builder.py"]
    assert set(derived) <= set(overlay.manifest.files)
    for path in overlay.manifest.files:
        assert (root / path).read_bytes() == overlay.content_of(path, None), path
