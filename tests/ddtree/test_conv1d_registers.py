"""tools/conv1d_registers.py compiles overlay ddtree's tree conv1d for the H200 here (Triton's own
ptxas, no GPU) and reports registers and spills: rc.10's launch at budget 64 (the whole tree over 32
channels, which run 25 timed) spills, and rc.12's launches there (16 rows over 32 channels; the whole
tree over 16 channels on a small grid), which run 26 measured faster, do not."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ddtree_deploy.pristine import pristine_release
from tests.ddtree.test_conv1d_tree_kernel import KERNEL, RC, SGLANG_KERNEL
from tests.overlay.plan_digests import BASE

TOOL = Path(__file__).resolve().parents[2] / "tools/conv1d_registers.py"


def test_rc10s_launch_at_budget_64_spills_and_rc12s_launches_do_not(tmp_path: Path) -> None:
    from ddtree_deploy.catalog import load_overlay
    from tests.ddtree.conftest import OVERLAYS

    kernel = tmp_path / "ddtree_conv1d.py"
    kernel.write_bytes(load_overlay(RC, OVERLAYS).content_of(KERNEL, None))
    child = subprocess.run([sys.executable, str(TOOL), str(kernel), "--sglang-file",
                            str(pristine_release(BASE) / SGLANG_KERNEL), "65x32x128x4", "65x32x16x4", "65x16x128x4"],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    found = [tuple(map(int, re.search(r"(\d+) registers, (\d+) bytes spilled", line).groups()))
             for line in child.stdout.splitlines()]
    (old_regs, old_spill), *new = found
    assert old_spill > 0 and len(new) == 2
    assert all(spill == 0 and regs < old_regs for regs, spill in new)
